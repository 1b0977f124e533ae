"""`python -m harness bench`: step time, communication, memory and harness throughput."""
