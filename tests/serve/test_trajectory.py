"""An episode's trajectory continues the sequence a re-sent prompt starts with, token for token."""

from __future__ import annotations

import math

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hybridflow.serve.trajectory import Trajectory

END = 3  # the end-of-turn word "w3": sampled last, left out of the answer's text


def words() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(64)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def answer(traj: Trajectory, text: str, sampled: list[int], ended: bool) -> None:
    prompt = traj.prompt(text)
    traj.record(
        prompt, sampled, [-0.5] * len(sampled), [0] * len(sampled), f"k{len(traj.sequences)}", "", ended
    )


def test_a_completions_client_resending_the_answer_without_its_end_token_continues_the_row() -> None:
    traj = Trajectory(words())
    answer(traj, "w10 w11 w12", [20, 21, END], ended=True)  # the client got back "w20 w21"
    # turn 2: the prompt, the answer's text, a tool's words; the sampled end token stays in the row
    answer(traj, "w10 w11 w12 w20 w21 w40 w41", [22, 23, 24, END], ended=True)
    # turn 3, with a prompt of different length: again the stem of the longest row
    answer(traj, "w10 w11 w12 w20 w21 w40 w41 w22 w23 w24 w42", [25], ended=False)
    (row,) = traj.leaves()
    assert traj.splits == 0 and traj.requests == 3
    assert row.tokens == [10, 11, 12, 20, 21, END, 40, 41, 22, 23, 24, END, 42, 25]
    assert row.prompt_len == 3
    assert row.mask == [1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1]
    assert [math.isnan(x) for x in row.logprobs] == [m == 0 for m in row.mask]


def test_a_prompt_that_holds_the_end_token_continues_after_it_and_an_edit_splits() -> None:
    traj = Trajectory(words())
    answer(traj, "w10 w11", [20, END], ended=True)
    answer(traj, "w10 w11 w20 w3 w30", [31], ended=False)  # a chat template re-renders the end token itself
    assert traj.splits == 0 and traj.leaves()[0].tokens == [10, 11, 20, END, 30, 31]
    answer(traj, "w10 w11 w29 w30", [32], ended=False)  # an edited answer: never trained as if sampled
    assert traj.splits == 1
    assert [r.tokens for r in traj.leaves()] == [[10, 11, 20, END, 30, 31], [10, 11, 29, 30, 32]]
    assert traj.leaves()[1].prompt_len == 4 and traj.leaves()[1].mask == [
        1
    ]  # its own prompt, then the answer
