"""Outputs returned before their all-reduce completes wait at first read."""
import torch

from flexflow.runtime.pending import Once, pending


def _make():
    calls = []
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()
    return w, pending(loss, Once(lambda: calls.append(1))), calls


def test_backward_does_not_wait_but_reads_do():
    w, loss, calls = _make()
    loss.backward()
    assert calls == [] and torch.equal(w.grad, torch.full((3,), 2.0))
    assert float(loss) == 6.0 and calls == [1]
    assert loss.item() == 6.0 and calls == [1]  # once only


def test_every_kind_of_read_waits():
    for read in (lambda t: t.item(), lambda t: t + 1, lambda t: t.detach(), lambda t: str(t),
                 lambda t: torch.stack([t, t]), lambda t: t.tolist()):
        _, loss, calls = _make()
        out = read(loss)
        assert calls == [1], read
        if isinstance(out, torch.Tensor):
            assert type(out) is torch.Tensor  # results are plain tensors


def test_shape_and_grad_fn_do_not_wait():
    _, loss, calls = _make()
    assert loss.shape == () and loss.requires_grad and loss.grad_fn is not None
    assert calls == []
