"""The paged engine on a vision-language model (issue 47): a tiny Qwen2.5-VL in float32, chat-templated prompts
with images of different sizes and a text-only prompt in one call. Prefill (whole and chunked through an image)
and decode logits equal HF's forward of the whole sequence; greedy generation equals HF's; rollout log-probs
equal a teacher-forced HF forward's; the samples of a prompt share one image prefill; two different images
behind the same token ids never share blocks; a sequence prefilled again (new weights) reruns its images."""

from __future__ import annotations

import pytest
import torch
from support.vlm_cases import (
    chat_prompt,
    hf_greedy,
    hf_logits,
    image,
    lively_qwen2_vl_model,
    lively_vl_model,
    prompts,
)

from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.hf_fallback import HFRollout
from hybridflow.engine.rollout.kv_cache import PagedKVCache
from hybridflow.engine.rollout.model import LlamaRunner
from hybridflow.engine.rollout.multimodal import chunk_inputs, image_features, mm_prompt
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.engine.rollout.sequence import Sequence
from hybridflow.models.tiny import build_tiny_model
from hybridflow.utils.errors import UserError

ATOL = 1e-5


@pytest.fixture(scope="module")
def vl():
    model, processor = lively_vl_model()
    ids, mms = prompts(processor)
    return model, processor, ids, mms


def greedy(max_new: int, n: int = 1, eos: tuple[int, ...] = ()) -> SamplingParams:
    return SamplingParams(n=n, max_new_tokens=max_new, do_sample=False, eos_token_ids=list(eos))


def test_prefill_and_decode_logits_equal_a_full_hf_forward(vl) -> None:
    model, processor, ids, mms = vl
    r = LlamaRunner(model)
    seqs = [
        Sequence(i, list(p), len(p), greedy(4), mm=mm_prompt(p, mm, r.image_token_id, r.merge_size))
        for i, (p, mm) in enumerate(zip(ids, mms))
    ]
    feats = dict(zip([0, 1], image_features(r.visual, [seqs[0].mm, seqs[1].mm], r.device, r.dtype)))
    block, per_seq = 8, 16
    cache = PagedKVCache(r.num_layers, per_seq * len(seqs), block, r.num_kv_heads, r.head_dim, r.dtype)
    tables = torch.tensor([list(range(k * per_seq, (k + 1) * per_seq)) for k in range(len(seqs))])  # (B, 16)
    # Prompt 1 in two chunks, the cut inside its first image: the second chunk's image tokens take the
    # features after those already cached, and attend to the cached half.
    cut = ids[1].index(processor.image_token_id) + 3
    calls = [
        [(seqs[0], 0, len(ids[0])), (seqs[1], 0, cut), (seqs[2], 0, len(ids[2]))],
        [(seqs[1], cut, len(ids[1]))],
    ]
    last = {}
    for call in calls:
        width = max(e - b for _, b, e in call)
        x = torch.tensor([s.tokens[b:e] + [0] * (width - e + b) for s, b, e in call])  # (b, t)
        images = chunk_inputs(call, feats, r.image_token_id, width)
        logits = r.prefill_paged(
            x,
            torch.tensor([e - b for _, b, e in call]),
            torch.tensor([b for _, b, _ in call]),
            cache,
            tables[[s.id for s, _, _ in call]],
            images,
        )
        last.update({s.id: logits[k] for k, (s, _, e) in enumerate(call) if e == len(s.tokens)})
    feed = [hf_greedy(model, processor, p, mm, 4, None) for p, mm in zip(ids, mms)]  # tokens to decode
    for k, (p, mm) in enumerate(zip(ids, mms)):
        want = hf_logits(model, processor, p + feed[k], mm)  # (T, V)
        torch.testing.assert_close(last[k], want[len(p) - 1], atol=ATOL, rtol=0)
    deltas = torch.tensor([0 if s.mm is None else s.mm.delta for s in seqs])
    assert deltas[:2].ne(0).all()  # images move the text after them: decode must use position + delta
    for j in range(3):
        tokens = torch.tensor([f[j] for f in feed])  # (B,)
        positions = torch.tensor([len(p) + j for p in ids])  # (B,)
        logits = r.decode_paged(tokens, positions, cache, tables, None, positions + deltas)  # (B, V)
        for k, (p, mm) in enumerate(zip(ids, mms)):
            want = hf_logits(model, processor, p + feed[k], mm)[len(p) + j]
            torch.testing.assert_close(logits[k], want, atol=ATOL, rtol=0)


def test_greedy_generation_equals_hf_greedy_with_eos_at_different_places(vl) -> None:
    model, processor, ids, mms = vl
    free = PagedEngine(model, block_size=8).generate(ids, greedy(16), mm_inputs=mms)
    # Two ids the free runs produce at different steps, as EOS: the responses end at different places.
    eos = (free[0][0].token_ids[3], free[2][0].token_ids[7])
    out = PagedEngine(model, block_size=8).generate(ids, greedy(16, n=2, eos=eos), mm_inputs=mms)
    lengths = set()
    for k, (p, mm) in enumerate(zip(ids, mms)):
        want = hf_greedy(model, processor, p, mm, 16, list(eos))
        assert [s.token_ids for s in out[k]] == [want, want]
        lengths.add(len(want))
    assert len(lengths) == 3


def test_rollout_log_probs_equal_a_teacher_forced_hf_forward(vl) -> None:
    model, processor, ids, mms = vl
    params = SamplingParams(n=2, max_new_tokens=10, temperature=1.0, seed=3)
    engine = PagedEngine(model, block_size=8)
    out = engine.generate(ids, params, mm_inputs=mms)
    for p, mm, samples in zip(ids, mms, out):
        assert samples[0].token_ids != samples[1].token_ids  # sampled, not copies
        for s in samples:
            logits = hf_logits(model, processor, p + s.token_ids, mm)[len(p) - 1 : -1]  # (R, V)
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(s.logprobs), want, atol=ATOL, rtol=0)
    stats = engine.last_stats  # two image prompts of three, n=2: the tower ran once per prompt
    assert stats.image_prefills == 2 and stats.prefill_tokens == sum(map(len, ids))
    assert engine.pool.stats.forked_blocks > 0


def test_different_images_behind_the_same_token_ids_never_share_blocks(vl) -> None:
    model, processor, _, _ = vl
    x, mx = chat_prompt(processor, "Count them.", [image(56, 56, 7)])
    y, my = chat_prompt(processor, "Count them.", [image(56, 56, 8)])
    assert x == y  # the pads of two images are the same ids
    engine = PagedEngine(model, block_size=4)
    out = engine.generate([x, x, y], greedy(8), mm_inputs=[mx, mx, my])
    got = [o[0].token_ids for o in out]
    assert got[0] == got[1] == hf_greedy(model, processor, x, mx, 8, None)
    assert got[2] == hf_greedy(model, processor, y, my, 8, None) != got[0]
    # The repeat of x found all its full blocks cached, y none: 1 of 3 prompts' blocks hit.
    assert engine.last_stats.prefix_cache_hit_rate == pytest.approx(1 / 3)


def test_a_sequence_prefilled_again_reruns_its_images(vl) -> None:
    model, processor, ids, mms = vl
    engine = PagedEngine(model, block_size=8)
    seq_ids = [engine.add(p, greedy(12), mm_inputs=mm)[0] for p, mm in zip(ids, mms)]
    engine.step(max_tokens=4)
    engine.pause()
    engine.resume(weights_changed=True)  # every running sequence is prefilled again at the next step
    done = {}
    while engine.has_work:
        done.update((s.id, s) for s in engine.step(max_tokens=4) if s.finish_reason is not None)
    assert engine.last_stats.image_prefills == 4  # 2 at admission, 2 at the re-prefill
    for i, p, mm in zip(seq_ids, ids, mms):
        assert done[i].response == hf_greedy(model, processor, p, mm, 12, None)


def test_hf_fallback_passes_the_images(vl) -> None:
    model, processor, ids, mms = vl
    out = HFRollout(model).generate(ids, greedy(6), mm_inputs=mms)
    for p, mm, samples in zip(ids, mms, out):
        assert samples[0].token_ids == hf_greedy(model, processor, p, mm, 6, None)


def test_a_text_model_refuses_images(vl) -> None:
    _, _, ids, mms = vl
    model = build_tiny_model("qwen2", vocab_size=256, hidden_size=32, num_hidden_layers=1).eval()
    with pytest.raises(UserError, match="multi_modal_inputs"):
        PagedEngine(model, block_size=8).generate(ids, greedy(2), mm_inputs=mms)
    with pytest.raises(UserError, match="multi_modal_inputs"):
        HFRollout(model).generate(ids, greedy(2), mm_inputs=mms)


def test_qwen2_vl_runs_the_same_way() -> None:
    model, processor = lively_qwen2_vl_model()
    assert model.config.text_config.model_type == "qwen2_vl_text"
    ids, mms = prompts(processor)
    out = PagedEngine(model, block_size=8).generate(ids, greedy(8), mm_inputs=mms)
    for p, mm, samples in zip(ids, mms, out):
        assert samples[0].token_ids == hf_greedy(model, processor, p, mm, 8, None)
