"""Requests' sampling parameters as logits rows: the SamplingMetadata of one step's rows, built from
request states (anything with ``params``, ``seed``, ``output_token_ids``, ``core_id`` and
``request_id``). The target's sampler and every proposer that samples build it here."""
from __future__ import annotations

from specinfer.request_error import RequestError
from specinfer.sample.metadata import RowParameterError, SamplingMetadata
from specinfer.sample.random_streams import RandomStreams


def sampling_metadata(states, rows_per_request=None, device=None, positions=None) -> SamplingMetadata:
    """One row per state (or rows_per_request[i] rows for state i) with its request's parameters;
    row i decides output position positions[i] (default: the request's next output token)."""
    p = [s.params for s in states]
    if positions is None:
        positions = [len(s.output_token_ids) for s in states]
    streams = RandomStreams.build([s.seed for s in states], positions)
    try:
        meta = SamplingMetadata.build(
            [x.temperature for x in p], [x.top_k for x in p], [x.top_p for x in p], [x.min_p for x in p],
            streams, device=device)
    except RowParameterError as e:  # one request's parameter, in the dtype the step uses: its failure
        st = states[e.row]
        raise RequestError([st.core_id], f"request {st.request_id!r}: SamplingParams.{e.field} fails in the "
                                         f"step ({e})") from e
    if rows_per_request is not None and any(n != 1 for n in rows_per_request):
        meta = meta.expand(rows_per_request)
    return meta


def all_greedy(states) -> bool:
    """Every request greedy: its rows take the argmax, and no metadata need be built (building it
    costs ~0.25 ms a step at batch 32)."""
    return all(s.params.temperature == 0.0 for s in states)
