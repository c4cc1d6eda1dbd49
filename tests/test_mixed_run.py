"""bf16-mixed runs for real: 2 and 4 gloo ranks against one process under torch.autocast(bfloat16)."""
import _mixed_workers as W
import pytest

import flexflow as ff
from flexflow.launch import launch


@pytest.mark.slow
@pytest.mark.parametrize("world,name,batch,specs", [
    (2, "mlp", 8, ["data_parallel", "model_parallel", "random:0", "fsdp", "shard:1"]),
    (2, "transformer", 8, ["data_parallel", "random:0", "fsdp", "megatron"]),
    (2, "llama", 8, ["megatron"]),  # q, k, v (and gate, up) share one received input and one cast
    (4, "mlp", 8, ["random:2", "shard:2"]),
    (4, "llama", 8, ["megatron"]),  # tp 4: collectives, the cast input gathered again in the backward
])
def test_bf16_mixed_trains_as_one_process_under_autocast(world, name, batch, specs):
    for spec, loss_errs, err, scale, worst, gathered in launch(W.mixed, world, name, batch, specs,
                                                               timeout_s=180)[0]:
        # sharded regions that only matrix products read are gathered (and held) in bfloat16,
        # as autocast would cast them anyway; the others (norm weights, embedding tables, a
        # weight tied to one) in float32
        for kinds, dtype in gathered:
            low = set(kinds) <= {"linear", "conv2d", "matmul"}
            assert dtype == ("torch.bfloat16" if low else "torch.float32"), (spec, kinds, dtype)
        if spec == "fsdp":
            assert (("linear",), "torch.bfloat16") in gathered
            if name == "transformer":
                assert (("layer_norm",), "torch.float32") in gathered
        # equal within bfloat16 rounding (8 bits of mantissa: 2**-8 = 0.4% an op) ...
        assert max(loss_errs) < 1e-3, (spec, loss_errs)
        assert err < 1e-2, (spec, err, worst)  # all parameters together (one small bias can be 5% off)
        # ... and the first loss far closer to autocast's than float32's is: mixed, not float32
        # (tensor parallelism adds its row-parallel partial sums, each rounded to bfloat16, in
        # float32, where one process rounds the whole product once: as close as float32 is)
        assert loss_errs[0] < (scale / 4 if spec != "megatron" else max(scale, 1e-5)), (spec, loss_errs[0], scale)


def test_unknown_and_unrun_precisions_are_refused_by_name():
    m, x = W.build("mlp", 4)
    for bad, words in (("fp8", "must be one of"), ("bf16-true", "module.to")):
        with pytest.raises(ValueError, match=words):
            ff.parallelize(m, example_inputs=x, strategy=None, precision=bad)


@pytest.mark.slow
def test_16_mixed_with_loss_scaling_trains_as_one_process_under_autocast():
    """float16 autocast with torch's ShardedGradScaler (which all-reduces the inf check, so
    every rank skips or takes the same steps) against one process with a GradScaler."""
    for spec, loss_errs, err, scales, ref_scale in launch(W.mixed16, 2, "mlp", 8, ["data_parallel", "fsdp",
                                                                                 "random:0"], timeout_s=180)[0]:
        assert max(loss_errs) < 1e-3 and err < 1e-2, (spec, loss_errs, err)  # float16: 11 bits of mantissa
        assert scales == [ref_scale] * 2 and ref_scale > 2.0 ** 14, (spec, scales, ref_scale)  # it grew alike


@pytest.mark.slow
@pytest.mark.parametrize("world,name,specs", [(2, "mlp", ["data_parallel", "fsdp", "random:0"]),
                                              (2, "transformer", ["fsdp", "megatron"]),
                                              (2, "llama", ["megatron", "fsdp"]),
                                              (4, "llama", ["megatron"])])  # (tp 4: collectives)
def test_bf16_params_trains_as_one_process_casting_its_parameters(world, name, specs):
    """precision="bf16-params" on flexflow's runtime (no autocast: parameters cast to bfloat16
    where ops read them, after the gradient gate; inputs, constants and messages bfloat16;
    sharded regions gathered in bfloat16) against one process that casts its parameters as
    FSDP2's MixedPrecisionPolicy does; float32 parameters, gradients and state."""
    for spec, loss_errs, err, scale, matmuls, dtypes, loss_dtype in launch(W.params16, world, name, 8, specs,
                                                                           timeout_s=180)[0]:
        # at most one bfloat16 step of the (bf16) loss; two where four tensor-parallel ranks add
        # their row-parallel partial sums in bfloat16 (as Megatron and DTensor do: the same with
        # the exchanges point to point)
        assert max(loss_errs) <= 0.008 * world / 2, (spec, loss_errs)
        # the parameters after 3 SGD steps: within bfloat16 rounding of the reference (float32
        # training lands as far from it: rounding differences grow alike over the steps)
        assert err < 1e-3 and err < 2 * scale, (spec, err, scale)
        assert matmuls == ["torch.bfloat16"], (spec, matmuls)  # every product of the forward in bfloat16
        assert dtypes == ["torch.float32"], (spec, dtypes)
        assert loss_dtype == "torch.float32", (spec, loss_dtype)  # returned (and summed) in its traced dtype
