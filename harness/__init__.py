"""The harness: is an FSDP implementation the same training run as the unsharded model?

Layout (`python -m harness VERB` enters through cli.py; docs/architecture.md follows one run from a case
to a report):
    cli.py     the parser of every verb and the one mapping of outcomes to exit codes; errors.py (the
               exceptions it maps), faults.py (the fault catalog), pytest_plugin.py (the fsdp_equivalence fixture)
    verbs/     one module per verb (run, gate, baseline, bisect, list, bench, fuzz, mutants), registered once
    run/       plan -> orchestrate (the parent's loop) -> launch (torchrun; prefork forks the ranks, lifeline
               ends them with the harness) -> rank (prologue, train_step) and worker (inside every rank) ->
               judged (rank 0 judges as it trains) or snapshot; collectives (the collective ledger),
               dist_faults (collective faults), evidence (a snapshot checked against the plan), outcome (what
               a launch left), output (the output directory), batch_makeup, param_groups, isolated (checks
               before any rank starts)
    adapters/  base (the Adapter protocol), ours, fsdp2, fsdp1, deepspeed, ddp, single, features (a case's
               Features onto an implementation), registry (`--impls` names), local_step (the
               forward/backward every rank runs)
    reference/ tolerance (the error model), shadow (the unsharded replay): below run/ and judge/
    judge/     checks/ (CHECKS: the registry of checks; base, buffers), diff (CellJudge: the per-step
               checks), segments (batched per-tensor checks), layouts, contracts, result (Violation,
               Verdict, Judgement), verdict (per-cell results, W x W matrices)
    report/    build (summary.json, csv), view, markdown, html, plots, junit, environment
    ci/        gate, baseline, bisect, bisect_step, mutants
    fuzz/      spec, strategies (public hypothesis strategies), search, pool (persistent ranks), worker (inside
               them), check, main (the run the verb starts)
    bench/     main, worker (inside the ranks), live_memory

[Note: Import walls] (tests/harness/test_walls.py reads every module's imports and enforces these):
1. judge/ and report/ read results; they import no process machinery (run/orchestrate, run/launch,
   run/prefork, run/lifeline, run/rank, fuzz/pool), no verb (cli, ci/) and no rank-side module.
2. A rank-side module (run/worker, fuzz/worker, bench/worker: what torchrun runs with `-m`) is
   imported by no other module of the harness: the parent never imports a worker. (run/prefork,
   the launcher that forks ranks, imports the one its command line names, by name, in its own
   process: [Note: Forked ranks].)
3. Only adapters/ours.py imports impl/ (bench/worker.py too: it measures impl's own units and
   flat-parameter handles, memory figures no adapter exposes).
4. No module imports a private name (a leading underscore) of another module, nor a private
   module of another package.
5. impl/ imports nothing of harness/ or cases/; cases/ imports nothing of harness/ or impl/.
6. adapters/ imports nothing else of the harness (errors aside); reference/ only adapters/: the
   error model and the replay sit below both the rank runtime and the judge.
"""
