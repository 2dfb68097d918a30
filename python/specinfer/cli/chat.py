"""`specinfer chat`: an interactive chat with an instruct model, its tokens streamed as accepted.

Reads one user message per line from stdin until EOF or /exit, so it works through a pipe too:
    printf 'Hi!\\nName three colors.\\n' | specinfer chat smollm2-135m -k 4
Commands: /exit (or /quit), /reset (forget the conversation).
"""
from __future__ import annotations

import sys
import time

from specinfer.cli import options

HELP = "chat with an instruct model (its own chat template), streaming tokens as they are accepted"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    options.add_model_argument(p)
    p.add_argument("--system", metavar="TEXT", help="system message (default: the template's own, if any)")
    p.add_argument("--quiet", action="store_true", help="no per-turn statistics on stderr")
    options.add_sampling_arguments(p, max_tokens=512)
    options.add_speculative_arguments(p)
    options.add_engine_arguments(p)


def run(args) -> int:
    options.check_model(args.model)
    spec = options.speculative_config(args)
    params = options.sampling_params(args)
    engine_config = options.engine_config(args, spec)
    gen = options.load_generator(engine_config)
    from specinfer.chat_template import ChatTemplate

    template = ChatTemplate.for_model(gen.engine.loaded)
    session = ChatSession(gen, template, params, system=args.system)
    interactive = sys.stdin.isatty()
    if interactive:
        note = " (no chat template in the model: using ChatML)" if template.is_fallback else ""
        print(f"chatting with {args.model}{note}; /exit to leave, /reset to start over", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            session.reset()
            continue
        if not text.strip():
            continue
        try:
            stats = session.turn(text, sys.stdout)
        except KeyboardInterrupt:
            if not interactive:
                raise
            session.messages.pop()  # Ctrl-C stops this answer, not the chat
            print("\n[interrupted]", file=sys.stderr, flush=True)
            continue
        except ValueError as e:  # e.g. the conversation no longer fits: this turn fails, the chat goes on
            print(f"specinfer chat: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
            continue
        if not args.quiet:
            print(stats, file=sys.stderr, flush=True)
    return 0


class ChatSession:
    """The conversation so far, rendered through the model's template at every turn."""

    def __init__(self, gen, template, params, system: str | None = None):
        self.gen, self.template, self.params, self.system = gen, template, params, system
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _prompt_ids(self) -> list[int]:
        """Token ids of the conversation; the oldest turns are dropped while it does not fit."""
        max_len = self.gen.engine.max_model_len
        limit = max_len - min(self.params.max_tokens, max_len // 2)  # room for the answer
        while True:
            ids = self.template.encode(self.gen.tokenizer, self.messages)
            first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
            if len(ids) <= limit or len(self.messages) - first <= 1:
                return ids
            del self.messages[first:first + 2]  # one user message and its answer

    def turn(self, user_text: str, out) -> str:
        self.messages.append({"role": "user", "content": user_text})
        try:
            ids = self._prompt_ids()
            self.gen.engine.validate(ids, self.params)
        except ValueError:
            self.messages.pop()
            raise
        t0 = time.perf_counter()
        final = None
        for step in self.gen.stream([ids], self.params):
            if step.new_text:
                out.write(step.new_text)
                out.flush()
            final = step
        out.write("\n")
        out.flush()
        elapsed = time.perf_counter() - t0
        self.messages.append({"role": "assistant", "content": final.text.strip()})
        n = len(final.token_ids)
        stats = f"[{n} tokens, {n / elapsed if elapsed > 0 else 0.0:.1f} tokens/s"
        if final.num_draft_tokens:
            stats += f", {final.num_accepted_tokens}/{final.num_draft_tokens} draft tokens accepted"
        return stats + f", finish: {final.finish_reason}]"
