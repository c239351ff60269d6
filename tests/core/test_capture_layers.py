"""`Transformer.forward(capture_layers=...)`: intermediate residual streams for EAGLE-3-style drafters."""
import pytest
import torch

PROMPT = [5, 6, 7, 8, 9, 10]


def test_outputs_equal_with_and_without_capture(tiny):
    tr = tiny.transformer
    tokens = torch.tensor([PROMPT])
    plain_logits, plain_hidden = tr.forward(tokens, tr.new_cache(1, 16), return_hidden=True)
    logits, wide = tr.forward(tokens, tr.new_cache(1, 16), return_hidden=True, capture_layers=(0, 2))
    assert torch.equal(logits, plain_logits)
    assert torch.equal(wide[..., :tr.hidden_size], plain_hidden)
    assert wide.shape[-1] == 3 * tr.hidden_size


def test_captured_states_are_the_residual_stream_after_each_layer(tiny):
    tr = tiny.transformer
    tokens = torch.tensor([PROMPT])
    _, wide = tr.forward(tokens, tr.new_cache(1, 16), return_hidden=True, capture_layers=(2, 0))
    reference = tiny.hf_model(tokens, output_hidden_states=True).hidden_states  # [0] = embeddings
    e = tr.hidden_size
    torch.testing.assert_close(wide[..., e:2 * e], reference[3], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(wide[..., 2 * e:], reference[1], atol=1e-4, rtol=1e-4)


def test_capture_of_a_layer_not_run_names_it(tiny):
    tr = tiny.transformer
    with pytest.raises(ValueError, match="capture_layers"):
        tr.forward(torch.tensor([PROMPT]), tr.new_cache(1, 16, n_layers=2), layers=[0, 1], capture_layers=(3,))
