"""`train.py --compile`: torch.compile each decoder layer (off by default).

The plain version is the eager layers (with speed/backward.py's tricks). The compiled layers are not
bit-identical to them, only equal to float rounding in float32, and under bf16 autocast their update is as far
from the float32 update as the eager one's: tests/test_grad_checkpointing.py::
test_compiled_layers_keep_loss_and_gradients_* and tests/test_train.py::test_compiled_bf16_*.
"""


def compile_layers(model):
    """torch.compile each decoder layer, with dynamic shapes, in place; returns the model.

    Per layer, not the whole model: every layer runs the same code, so one graph serves all of them, and a
    whole-model graph compiles far longer. Dynamic shapes: each step's sequence lengths differ. The layer is
    also FSDP2's unit (parallel.shard), so its hooks stay outside the graph; nn.Module.compile keeps the
    parameter names, so checkpoints and the weight sync see the same model. torch keeps the kernels in
    /tmp/torchinductor_$USER (or $TORCHINDUCTOR_CACHE_DIR) for the next run. On CPU it needs a C++ compiler.
    """
    for layer in model.model.layers:
        layer.compile(dynamic=True)
    return model
