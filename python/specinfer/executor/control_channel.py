"""The driver -> workers message channel on the gloo control group: each message pickled once and
broadcast whole, in ONE fixed-size broadcast when it fits (a second one carries the rest of a
large message). The driver's send is asynchronous: it overlaps with the driver's own handling of
the same message and is waited for at the end of the call (`flush`), so a failed send still
surfaces within the call, under the group's timeout.

broadcast_object_list would do two broadcasts per message (size, then payload) and wait for both
before the driver starts its own work.
"""
from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

CAPACITY = 16 << 10  # bytes per fixed broadcast: an 8-byte length, then the pickled message
_HEADER = 8


class ControlChannel:
    def __init__(self, group):
        self.group = group
        self._pending: list = []  # (work, buffer) of the driver's sends in flight

    def send(self, msg) -> None:
        """Driver: start broadcasting msg to every rank (returns before the workers received it)."""
        self.flush()
        blob = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        n = len(blob)
        head = torch.zeros(CAPACITY, dtype=torch.uint8)
        head[:_HEADER] = torch.frombuffer(bytearray(n.to_bytes(_HEADER, "little")), dtype=torch.uint8)
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        if n <= CAPACITY - _HEADER:
            head[_HEADER:_HEADER + n] = data
            self._pending = [(dist.broadcast(head, src=0, group=self.group, async_op=True), head)]
        else:
            self._pending = [(dist.broadcast(head, src=0, group=self.group, async_op=True), head),
                             (dist.broadcast(data, src=0, group=self.group, async_op=True), data)]

    def flush(self) -> None:
        """Driver: wait until the message in flight has left (raises if a rank is gone)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    def recv(self):
        """Worker: the next message from the driver (blocks as long as the group's timeout)."""
        head = torch.empty(CAPACITY, dtype=torch.uint8)
        dist.broadcast(head, src=0, group=self.group)
        n = int.from_bytes(head[:_HEADER].numpy().tobytes(), "little")
        if n <= CAPACITY - _HEADER:
            return pickle.loads(head[_HEADER:_HEADER + n].numpy().tobytes())
        data = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.group)
        return pickle.loads(data.numpy().tobytes())
