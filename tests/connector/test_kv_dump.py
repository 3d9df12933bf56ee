"""kv_dump_dir's copies: what they hold, when they are taken, their bounds."""

import numpy as np

from kvpath.connector import kv_dump
from kvpath.connector.kv_dump import KVDump, dump_path
from kvpath.connector.layout import layout_from_buffers
from kvpath.connector.messages import BlockLayout, Compat


def test_a_copy_holds_the_blocks_as_they_were_when_taken(tmp_path):
    bufs = [np.arange(4 * 64, dtype=np.uint8) + i for i in range(2)]  # 2 layers, 4 blocks of 64 B
    lay = layout_from_buffers([(b.ctypes.data, b.nbytes) for b in bufs], num_blocks=4, block_size=16)
    d = KVDump(str(tmp_path), "d", 1)
    copied = d.copy("../../etc/x", lay, Compat(tp_size=2, tp_rank=1, kv_heads=4), [2, 0], skip_blocks=1)
    bufs[0][:] = 0  # the blocks are reused after the copy: the dump must not see it
    d.save(copied)
    path = dump_path(tmp_path, "d", "../../etc/x", 1)
    assert path.parent == tmp_path and path.name.startswith("d-") and path.name.endswith("-r1.npz")
    got = np.load(path)
    assert got["kv"].shape == (2, 2, 64) and list(got["heads"]) == [2, 3]
    assert bytes(got["kv"][0, 0]) == bytes((np.arange(128, 192) % 256).astype(np.uint8))
    assert bytes(got["kv"][1, 1]) == bytes((np.arange(0, 64) + 1).astype(np.uint8))
    assert int(got["block_size"]) == 16 and int(got["skip_blocks"]) == 1


def test_dumps_stop_at_their_bound_and_never_read_device_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_dump, "MAX_DUMPS", 2)
    buf = np.zeros(128, dtype=np.uint8)
    lay = layout_from_buffers([(buf.ctypes.data, buf.nbytes)], num_blocks=2, block_size=16)
    d = KVDump(str(tmp_path), "p", 0)
    for i in range(4):
        d.write(f"t{i}", lay, Compat(), [0])
    assert len(list(tmp_path.glob("*.npz"))) == 2
    vram = BlockLayout(regions=lay.regions, num_blocks=2, block_size=16, mem_type="VRAM")
    v = KVDump(str(tmp_path / "v"), "p", 0)
    assert v.copy("t", vram, Compat(), [0]) is None and not list((tmp_path / "v").glob("*"))
