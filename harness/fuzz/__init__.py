"""`python -m harness fuzz`: drawn models through a persistent rank pool, judged by the judge."""
