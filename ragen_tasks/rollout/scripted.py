"""ScriptedEngine: a test double of the Engine Protocol that replies with scripted text.

For unit tests of the loop's edges (garbage answers, dropped replies, the token cap, episodes that
end on turn 1, max turns). ``reply(session_id, call_index) -> str`` gives the text of each
response; the double tokenises that text (this is its "sampling"; the loop itself never
re-tokenises), cuts it after the first stop string (finish "stop") or at ``max_new_tokens``
(finish "length"), optionally appends the eos id (finish "eos"), and reports a fixed log-prob
per token. It records every call and every release, and checks the KV-cache contract: a session's
new prompt must extend its previous prompt + generated ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from ragen_tasks.rollout.engine import Generation, GenerationRequest, SamplingParams

Reply = Callable[[str, int], str]  # (session_id, index of this session's call) -> response text


class ScriptedEngine:
    """Replies with scripted text. ``drop_replies`` > 0 returns that many fewer generations."""

    def __init__(
        self,
        tokenizer: Any,
        reply: Reply | str,
        *,
        logprob: float = -0.5,
        append_eos: bool = False,
        drop_replies: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.reply: Reply = (lambda _sid, _i: reply) if isinstance(reply, str) else reply
        self.logprob = logprob
        self.append_eos = append_eos
        self.drop_replies = drop_replies
        self.calls: list[list[GenerationRequest]] = []  # every generate() batch, in order
        self.released: list[str] = []  # session ids, in release order
        self._history: dict[str, list[int]] = {}  # session -> prompt + generated ids of its last call
        self._turns: dict[str, int] = {}

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Generation]:
        self.calls.append(list(requests))
        out: list[Generation] = []
        for request in requests:
            previous = self._history.get(request.session_id)
            prompt = list(request.prompt_ids)
            if previous is not None and prompt[: len(previous)] != previous:
                raise AssertionError(f"session {request.session_id}: new prompt does not extend the last one")
            index = self._turns.get(request.session_id, 0)
            self._turns[request.session_id] = index + 1
            gen = self._one(self.reply(request.session_id, index), params)
            self._history[request.session_id] = prompt + gen.token_ids
            out.append(gen)
        return out[: len(out) - self.drop_replies] if self.drop_replies else out

    def _one(self, text: str, params: SamplingParams) -> Generation:
        finish: Literal["stop", "eos", "length"] = "length"
        for stop in params.stop_strings:
            if stop in text:
                text = text[: text.index(stop) + len(stop)]
                finish = "stop"
                break
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if finish != "stop" and self.append_eos:
            ids.append(int(self.tokenizer.eos_token_id))
            finish = "eos"
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
        decoded = self.tokenizer.decode(ids, skip_special_tokens=False)
        return Generation(token_ids=ids, logprobs=[self.logprob] * len(ids), finish_reason=finish, text=decoded)

    def release(self, session_ids: Sequence[str]) -> None:
        for sid in session_ids:
            self.released.append(sid)
            self._history.pop(sid, None)
