"""`python -m harness list`: the cases, the implementations and the planted faults."""

from __future__ import annotations

NAME = "list"
IMPORTS_PROJECT = False
TAKES_EXTRA = False


def add_parser(verbs) -> None:
    verbs.add_parser("list", help="cases, implementations and planted faults")


def run(args, extra: list[str], argv: list[str]) -> bool:
    from cases.catalog import CASES
    from harness.adapters.registry import BUILTIN_IMPLS

    print("cases:")
    for case in CASES.values():
        print(f"  {case.name}: {case.description}; optimizers {[o.kind for o in case.optimizers]}, "
              f"steps={case.steps}, global_batch={case.global_batch}, world sizes {list(case.world_sizes)}, "
              f"data {list(case.data_modes)}")
    print("impls: " + ", ".join(BUILTIN_IMPLS) + " (or module:Class / file.py:Class)")
    from harness.faults import of_layer

    for layer, title in (("impl", "faults (run --faults NAME, planted in impl=ours)"),
                         ("collective", "collective faults (run --faults NAME, in what torch.distributed delivers: any "
                                        "implementation, W > 1)"),
                         ("loop", "training-loop faults (run --faults NAME, in the loop the harness drives: any "
                                  "implementation, any W)")):
        print(title + ":")
        for fault in of_layer(layer).values():
            print(f"  {fault.name}: {fault.plants}")
    return True
