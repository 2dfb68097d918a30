"""Faults injected into the engine's step, and the engine driven as a server drives it: shared by
the step-transaction tests and the seeded-tree tests."""


class Injector:
    """Wraps a callable so that it raises at chosen call numbers (once per number)."""

    def __init__(self, fn, fail_at: set[int], exc_types):
        self.fn, self.fail_at, self.exc_types = fn, set(fail_at), exc_types
        self.calls = self.raised = 0

    def install(self, obj, name: str) -> "Injector":
        """setattr(obj, name, self); -> self."""
        setattr(obj, name, self)
        return self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.fail_at:
            self.raised += 1
            exc = self.exc_types[self.raised % len(self.exc_types)]
            raise exc("injected fault")
        return self.fn(*args, **kwargs)


def run_engine(gen, prompts, params, names_prefix="r"):
    """Drive the engine directly (as a server would); faults surface as exceptions from step()
    and are swallowed; returns {name: token_ids} and the number of faults seen."""
    eng = gen.engine
    names = [f"{names_prefix}{i}" for i in range(len(prompts))]
    for n, p in zip(names, prompts):
        eng.add_request(n, p, params)
    done, faults = {}, 0
    for _ in range(5000):
        if not eng.has_unfinished_requests():
            break
        try:
            outs = eng.step(final_only=True)
        except (RuntimeError, KeyboardInterrupt, MemoryError):
            faults += 1
            continue
        for o in outs:
            if o.finished:
                done[o.request_id] = o.token_ids
    assert not eng.has_unfinished_requests()
    return done, faults
