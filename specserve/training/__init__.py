"""Self-distillation of drafter heads: `specserve train-drafter`.

`data` has the target answer GPTeacher instructions (batched through specserve's own engine)
and records its hidden states over those answers; `heads` holds the trainable heads; `train`
runs the loop and writes a checkpoint that `drafters.heads` loads.
"""
