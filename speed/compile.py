"""`--compile`: torch.compiled decoder layers; the plain version is eager (equal to float rounding).

python -m pytest tests/test_grad_checkpointing.py -k compiled
"""


# SPEED TRICK: tests/test_grad_checkpointing.py::test_compiled_layers_* and tests/test_train.py::
# test_compiled_run_matches_the_plain_run (equal to float rounding): fused kernels for the layers' elementwise work
def compile_layers(model):
    """torch.compile each decoder layer (dynamic shapes), in place; on CPU it needs a C++ compiler."""
    for layer in model.model.layers:
        layer.compile(dynamic=True)
    return model
