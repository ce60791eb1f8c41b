"""Sampling parameters and next-token sampling for the rollout engine, with no host-device sync.

Sampling uses the exponential race: for probabilities ``p`` and independent ``E_i ~ Exp(1)``,
``argmax_i p_i / E_i`` is distributed as ``Categorical(p)`` (it is the Gumbel-max trick in another form,
``-log E`` being Gumbel). Unlike ``torch.multinomial`` it needs no host sync and has static shapes, so it can
sit inside a captured CUDA graph.

Cost model (benchmarks/RESULTS.md, measured anchors, batch 256 x 151,936 vocab on an H200): temperature + exponential race
0.43 ms, a sort-based top-p 4.1 ms. So the default (no filter) path never sorts or runs top-k over the
vocabulary; top-k runs first and top-p / min-p work only on its k survivors when asked. Top-p without top-k
has to sort the whole vocabulary.

Measured with this module (H200, torch 2.11, batch 256 x 151,936 bf16 logits, eager or in a CUDA graph,
log-probs included): no filter 0.52 ms at T = 1, 0.59 ms at T != 1; greedy 0.32 ms (0.06 ms without
log-probs); top-k 50 0.43 ms, with top-p and min-p on its survivors 0.44 ms; min-p alone 0.91 ms; top-p
alone (full sort) 2.8 ms.

On CUDA the rollout engine sends greedy and unfiltered sampling to ``sample_kernel.fused_sample`` instead:
one Triton pass over the LM head's bf16 logits (Gumbel-max with Triton's Philox RNG, the log-sum-exp and
the argmax together). Same distribution and log-prob semantics as ``sample`` below, different random
numbers; this module keeps filtered sampling, CPU runs, and the reference the kernel is tested against.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from hybridflow.engine.ops.invariant import exact_on, token_log_probs
from hybridflow.utils.errors import UserError

# Smallest normal float32. Exp(1) draws can be exactly 0 on CPU; clamping them to this keeps p / E finite:
# p <= 1, so p / tiny <= 8.5e37 < float32 max (3.4e38).
_TINY = torch.finfo(torch.float32).tiny


def _token_id_list(name: str, value: int | Iterable[int] | None) -> list[int]:
    """Normalise an id or a list of ids to ``list[int]`` (HF configs store ``eos_token_id`` either way)."""
    if value is None:
        return []
    ids = [value] if isinstance(value, int) else list(value)
    for tok in ids:
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise UserError(f"{name} must hold non-negative integer token ids, got {tok!r} in {value!r}")
    return ids


def _check_int(name: str, value: object, low: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise UserError(f"{name} must be >= {low}, got {value}; {hint}")


@dataclass
class SamplingParams:
    """How to pick the next tokens of one generate() call; validated on construction.

    ``do_sample=False`` (or ``temperature=0`` together with it) is greedy decoding; top-k, top-p and min-p
    are then ignored. Filters are applied in Hugging Face's order: top-k, then top-p over the renormalised
    top-k survivors, then min-p (which only compares each probability with the largest one).
    """

    n: int = 1  # samples per prompt
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 is greedy and needs do_sample=False
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0  # in (0, 1]; 1: off
    min_p: float = 0.0  # in [0, 1); 0: off
    do_sample: bool = True  # False: greedy whatever the temperature
    eos_token_ids: list[int] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end a sequence
    ignore_eos: bool = False  # keep generating past EOS (benchmarks); stop_token_ids still stop
    seed: int | None = None
    logprobs: bool = True  # return the log-prob of each sampled token

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1, "ask for at least one sample per prompt")
        _check_int("max_new_tokens", self.max_new_tokens, 1, "generate at least one token")
        _check_int("top_k", self.top_k, -1, "use top_k=-1 (or 0) to switch top-k off, or a value >= 1")
        for name in ("do_sample", "ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool (true/false), got {getattr(self, name)!r}")
        self.temperature, self.top_p, self.min_p = (
            float(self.temperature),
            float(self.top_p),
            float(self.min_p),
        )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise UserError(
                f"temperature must be a finite number >= 0, got {self.temperature}; use 0 with "
                "do_sample=false for greedy decoding"
            )
        if self.do_sample and self.temperature == 0:
            raise UserError(
                "temperature=0 with do_sample=true cannot sample: set do_sample=false for greedy "
                "or temperature > 0"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}; use top_p=1.0 to switch top-p off")
        if not 0.0 <= self.min_p < 1.0:
            raise UserError(f"min_p must be in [0, 1), got {self.min_p}; use min_p=0.0 to switch min-p off")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        self.eos_token_ids = _token_id_list("eos_token_ids", self.eos_token_ids)
        self.stop_token_ids = _token_id_list("stop_token_ids", self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of the logits."""
        return not self.do_sample or self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        """True when sampling truncates the distribution (top-k, top-p or min-p active).

        Then the returned log-probs are those of the truncated distribution and differ from the trainer's
        recomputation at ``logits / temperature``.
        """
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def logprob_temperature(self) -> float:
        """Temperature the returned log-probs are taken at: ``temperature``, or 1 when it is 0 (greedy)."""
        return self.temperature if self.temperature > 0 else 1.0


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator on ``device`` seeded with ``seed``, or None (use torch's global RNG) when seed is None."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def _scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in float32; read-only: it is the input itself when nothing changes."""
    if logits.dtype == torch.float32:
        return logits / temperature if temperature != 1.0 else logits
    return logits.float().div_(temperature) if temperature != 1.0 else logits.float()  # .float() copies


def _softmax_at(logits: torch.Tensor, temperature: float, log: bool = False) -> torch.Tensor:
    """(log-)softmax of ``logits / temperature`` in float32 (B, V)."""
    fn = torch.log_softmax if log else torch.softmax
    if temperature == 1.0:  # the kernel upcasts as it reads: no float32 copy of the logits
        return fn(logits, dim=-1, dtype=torch.float32)
    return fn(_scale(logits, temperature), dim=-1)


def _race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Index of argmax(probs / E), E ~ Exp(1) i.i.d.: one categorical draw per row of ``probs`` (B, K)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)  # (B, K)
    if noise.device.type != "cuda":
        # The CPU kernel computes -log1p(-u) with u in [0, 1), so E == 0 happens; 0 / 0 would be NaN and
        # argmax would pick that zero-probability token. CUDA's kernel never returns 0 (it maps u == 1 to
        # eps / 2, pytorch issue 16706), so the extra pass over (B, V) is skipped there.
        noise.clamp_min_(_TINY)
    return torch.div(probs, noise, out=noise).argmax(dim=-1)  # (B,): divides into noise, probs stay intact


def _keep_mask(scaled: torch.Tensor, params: SamplingParams, is_sorted: bool) -> torch.Tensor:
    """Candidates that survive top-p and min-p, given their scaled logits (sorted descending when asked)."""
    keep = torch.ones_like(scaled, dtype=torch.bool)  # (B, K)
    if params.top_p < 1.0:
        assert is_sorted, "top-p needs candidates sorted by probability"
        probs = torch.softmax(scaled, dim=-1)  # (B, K): renormalised over the candidates (top-k survivors)
        # Keep a token when the mass strictly above it is < top_p: the smallest prefix with mass >= top_p.
        # The first token has 0 mass above it, so at least one token always survives.
        mass_above = torch.cumsum(probs, dim=-1) - probs  # (B, K)
        keep &= mass_above < params.top_p
    if params.min_p > 0.0:
        # p >= min_p * p_max  <=>  x >= x_max + log(min_p) for x = logits / T: no softmax needed, and the
        # ratio test is unaffected by renormalisation, so it may come after top-p. The top token survives.
        x_max = scaled[:, :1] if is_sorted else scaled.amax(dim=-1, keepdim=True)  # (B, 1)
        keep &= scaled >= x_max + math.log(params.min_p)
    return keep


def _sample_filtered(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, then top-p / min-p on the survivors, then the race among what is left."""
    vocab = logits.shape[-1]
    # Select on the raw logits: dividing by T > 0 keeps the order, and only the K survivors get cast.
    if 0 < params.top_k < vocab:
        cand, cand_ids = torch.topk(logits, params.top_k, dim=-1)  # (B, K), sorted descending
    elif params.top_p < 1.0:
        cand, cand_ids = torch.sort(logits, dim=-1, descending=True)  # (B, V): top-p needs the order
    else:  # min-p alone, or top_k >= V: no ordering needed
        cand, cand_ids = logits, None
    scaled = _scale(cand, params.temperature)  # (B, K) float32
    keep = _keep_mask(scaled, params, is_sorted=cand_ids is not None)  # (B, K)
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)  # (B, K), 0 where dropped
    choice = _race(probs, generator)[:, None]  # (B, 1)
    logprobs = probs.gather(-1, choice).squeeze(-1).log()  # (B,)
    tokens = choice if cand_ids is None else cand_ids.gather(-1, choice)  # (B, 1)
    return tokens.squeeze(-1), logprobs


def sample(
    logits: torch.Tensor,  # (B, V)
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one next token per row; return ``(tokens (B,) int64, logprobs (B,) float32)``.

    Log-prob semantics (what the trainer must compare with), with ``x = logits.float() / T``:

    * sampling, no filter (top_k off, top_p=1, min_p=0; the default): ``log(softmax(x)[token])``, i.e.
      ``log_softmax(logits / T)[token]`` up to float32 rounding (~1e-6): exactly what the trainer
      recomputes at ``logits / temperature``.
    * sampling with filters: the log-prob under the distribution actually sampled from, i.e. ``x``
      restricted to the surviving tokens (top-k, then top-p over the renormalised survivors, then min-p)
      and renormalised over them. It is >= the unfiltered log-prob the trainer recomputes, which ignores
      the filters.
    * greedy: ``argmax(logits)`` (first index on ties), with ``log_softmax(logits / T)[token]`` where T is
      ``params.logprob_temperature`` (the temperature, or 1 when it is 0), unfiltered. So a greedy rollout
      at the training temperature reports what the trainer recomputes.
    * ``params.logprobs=False``: zeros (the greedy path then skips its log-softmax over V).

    The fused kernel (``sample_kernel.fused_sample``, the rollout engine's path on CUDA for greedy and
    unfiltered params) keeps these semantics: it returns ``z_token - logsumexp(z)`` with
    ``z = logits.float() * (1 / T)``, equal to the above up to float32 rounding (~1e-6), and the same
    greedy tokens; its samples come from the same distribution through other random numbers.

    ``generator`` must live on ``logits.device``; None uses torch's global RNG. CUDA-graph friendly: static
    shapes, no ``.item()``, Python branches only on ``params``, dtypes and shapes. Under graph capture a
    non-default generator must be registered with the graph (``CUDAGraph.register_generator_state``) for
    its draws to advance on replay. ``logits`` is never modified.
    """
    if logits.dim() != 2:
        raise ValueError(f"sample expects logits of shape (B, V), got {tuple(logits.shape)}")
    if exact_on() and params.logprobs:  # rollout.exact: the trainer's formula on the same kernels
        tokens, _ = sample(logits, dataclasses.replace(params, logprobs=False), generator)
        return tokens, token_log_probs(logits, tokens, params.logprob_temperature)
    if params.greedy:
        tokens = logits.argmax(dim=-1)  # (B,) on the raw logits: T > 0 does not change the order
        if not params.logprobs:
            return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
        logp = _softmax_at(logits, params.logprob_temperature, log=True)  # (B, V)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    if params.filtered:
        tokens, logprobs = _sample_filtered(logits, params, generator)
    else:
        # Fast path: no sort, no top-k over V; float32 because a softmax over 150k entries needs the range.
        probs = _softmax_at(logits, params.temperature)  # (B, V)
        tokens = _race(probs, generator)  # (B,)
        logprobs = probs.gather(-1, tokens[:, None]).squeeze(-1).log()  # (B,)
    return tokens, logprobs if params.logprobs else torch.zeros_like(logprobs)
