"""Builders the real-NIXL tests share: a config on ports of their own, P's writer
in this process over random KV buffers (:class:`PSide`), the buffers' spec; D runs in
another process (``kvpath.testbed.peer_process.PeerProcess``)."""

import time

from kvpath.connector.config import KVPathConfig
from kvpath.connector.layout import layout_from_buffers
from kvpath.connector.sender import PushSender
from kvpath.testbed.peer_process import BufferSpec, make_buffers

SPEC = BufferSpec(regions=3, num_blocks=96, block_len=2048, block_size=16)
_port = [5900]
KEYS: dict[str, str] = {}  # the control channel's keys: filled by the conftest's ``nixl_keys``


def cfg(**kw) -> KVPathConfig:
    _port[0] += 3
    base = dict(side_channel_port=_port[0], ucx_net_devices="lo", lease_timeout_s=3.0, registration_timeout_s=4.0,
                max_wait_s=6.0, fence_grace_s=0.3, **KEYS)
    base.update(kw)
    return KVPathConfig(**base)


class PSide:
    def __init__(self, c: KVPathConfig, compat=None):
        self.bufs = make_buffers(SPEC, "random", seed=7)
        spans = [(b.ctypes.data, b.nbytes) for b in self.bufs]
        lay = layout_from_buffers(spans, SPEC.num_blocks, SPEC.block_size)
        compat = compat(lay) if callable(compat) else compat
        self.sender = PushSender(c, lay, spans, compat=compat).start()

    def expect(self, blocks):
        return self.expect_blocks(SPEC, blocks)

    def expect_blocks(self, spec: BufferSpec, blocks):
        return [b.reshape(spec.num_blocks, spec.block_len)[blocks].tobytes() for b in self.bufs]

    def wait_released(self, rids, timeout=10.0):
        got, deadline = set(), time.monotonic() + timeout
        while time.monotonic() < deadline and not set(rids) <= got:
            got |= self.sender.take_finished()
            time.sleep(0.005)
        return got
