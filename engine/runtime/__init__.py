"""The bound Engine and what runs it: its options, sequences, stop rules, prompt scoring, the chained greedy decode,
and the continuous-batching scheduler."""
