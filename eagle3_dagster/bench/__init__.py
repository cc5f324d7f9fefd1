"""Benchmarks of a trained drafter: acceptance length and throughput.

`specdec` simulates EAGLE-3 chain drafting in-process against the target (CPU
or anywhere; exact greedy output, SGLang's accounting), with `proposers` for
the drafter, n-gram prompt lookup and test references; `served` measures an
SGLang server; `prompts` builds the prompt sets; `report` renders markdown,
plots and the comparison with the previous run from either benchmark's rows.
"""
