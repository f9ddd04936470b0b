"""The GPU platform's attention choice works without flash-attn: SDPA on packed micro-batches
(``use_remove_padding: true``) gives every packed sequence the logits it has alone. Runs on CPU: the
masking is transformers' (packed sequences told apart by restarting position ids), not a CUDA kernel."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from envace.verl.config import compose


def tiny_qwen3(attn: str) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    cfg._attn_implementation = attn
    return Qwen3ForCausalLM(cfg).eval()


def test_gpu_platform_uses_sdpa_with_packed_micro_batches():
    model = compose(["platform=gpu"]).actor_rollout_ref.model
    assert model.override_config.attn_implementation == "sdpa"
    assert model.use_remove_padding is True


def test_sdpa_on_a_packed_row_equals_each_sequence_alone():
    model = tiny_qwen3("sdpa")
    lens = [7, 12, 5]
    seqs = [torch.randint(0, 512, (n,)) for n in lens]
    with torch.no_grad():
        alone = [model(input_ids=s[None]).logits[0] for s in seqs]
        ids = torch.cat(seqs)[None]
        restart = torch.cat([torch.arange(n) for n in lens])[None]
        # verl's remove-padding call: one row, restarting position ids, no mask, use_cache=False (with a KV
        # cache transformers would not look for packed sequences)
        packed = model(input_ids=ids, position_ids=restart, use_cache=False).logits[0]
        one_long = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits[0]
    assert torch.allclose(packed, torch.cat(alone), atol=1e-5)
    # the check can fail: read as one sequence, the later sequences attend to the earlier ones
    assert not torch.allclose(one_long[lens[0]:], torch.cat(alone[1:]), atol=1e-3)
    # and SDPA agrees with the eager kernel
    eager = tiny_qwen3("eager")
    eager.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.allclose(eager(input_ids=ids, position_ids=restart, use_cache=False).logits[0], packed, atol=1e-5)
