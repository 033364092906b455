"""The system shared-memory extension with the real client: tritonclient's own shared-memory
helpers (`tritonclient.utils.shared_memory`, POSIX objects under /dev/shm) over HTTP and gRPC,
every datatype of the dtypes model (which flips its inputs) including BYTES and BF16; then the
attacks: lying offsets and sizes, another tenant's keys and regions, an object truncated or
unlinked under a registered region, a symbolic link, an output slice too small, CUDA shared
memory."""

from __future__ import annotations

import os
import uuid

import grpc as grpc_lib
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.service_pb2 as pb
import tritonclient.grpc.service_pb2_grpc as pb_grpc
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient import utils
from tritonclient.utils import InferenceServerException

from serve_util import (
    NP_DTYPES,
    assert_tensor_equal,
    dtypes_data,
    grpc_headers,
    http_headers,
    request,
)

HH, GH = http_headers("alice"), grpc_headers("alice")
BOB_H, BOB_G = http_headers("bob"), grpc_headers("bob")


def _serialized(dt: str, arr: np.ndarray) -> np.ndarray:
    """What goes into shared memory for ARR: BYTES serialized as the binary extension does."""
    if dt == "BYTES":
        return utils.serialize_byte_tensor(arr)
    return np.ascontiguousarray(arr)


def _nbytes(dt: str, arr: np.ndarray) -> int:
    return utils.serialized_byte_size(_serialized(dt, arr)) if dt == "BYTES" else arr.nbytes


class Regions:
    """An input and an output region (alice's keys), laid out for DATA, and their cleanup."""

    def __init__(self, data: dict, tag: str):
        self.data = data
        self.sizes = {dt: _nbytes(dt, a) for dt, a in data.items()}
        self.offsets, off = {}, 0
        for dt in data:
            self.offsets[dt] = off
            off += self.sizes[dt]
        # Outputs have the inputs' sizes (the model flips elements in place).
        self.total = off
        u = uuid.uuid4().hex[:8]
        self.in_name, self.out_name = f"in-{tag}-{u}", f"out-{tag}-{u}"
        self.in_key, self.out_key = f"/alice-in-{u}", f"/alice-out-{u}"
        self.inp = shm.create_shared_memory_region(self.in_name, self.in_key, self.total)
        self.out = shm.create_shared_memory_region(self.out_name, self.out_key, self.total)
        for dt, a in data.items():
            shm.set_shared_memory_region(self.inp, [_serialized(dt, a)], offset=self.offsets[dt])

    def close(self):
        shm.destroy_shared_memory_region(self.inp)
        shm.destroy_shared_memory_region(self.out)

    def check_outputs(self, what: str):
        for dt, a in self.data.items():
            np_dt = np.object_ if dt == "BYTES" else NP_DTYPES[dt]
            got = shm.get_contents_as_numpy(self.out, np_dt, list(a.shape), offset=self.offsets[dt])
            assert_tensor_equal(dt, got, np.flip(a, axis=-1), f"{what}: OUTPUT_{dt}")


def test_shared_memory_inference_over_http_and_grpc(http, grpc):
    data = dtypes_data(shape=(2, 3), seed=90)
    r = Regions(data, "both")
    try:
        http.register_system_shared_memory(r.in_name, r.in_key, r.total, headers=HH)
        http.register_system_shared_memory(r.out_name, r.out_key, r.total, headers=HH)
        status = {s["name"]: s for s in http.get_system_shared_memory_status(headers=HH)}
        assert status[r.in_name] == {"name": r.in_name, "key": r.in_key, "offset": 0, "byte_size": r.total}
        # HTTP: inputs from the input region, outputs into the output region.
        inputs, outputs = [], []
        for dt, a in data.items():
            i = httpclient.InferInput(f"INPUT_{dt}", list(a.shape), dt)
            i.set_shared_memory(r.in_name, r.sizes[dt], offset=r.offsets[dt])
            inputs.append(i)
            o = httpclient.InferRequestedOutput(f"OUTPUT_{dt}", binary_data=True)
            o.set_shared_memory(r.out_name, r.sizes[dt], offset=r.offsets[dt])
            outputs.append(o)
        res = http.infer("dtypes", inputs, outputs=outputs, headers=HH)
        for dt in data:
            out = res.get_output(f"OUTPUT_{dt}")
            assert out["parameters"]["shared_memory_region"] == r.out_name, out
            assert out["parameters"]["shared_memory_byte_size"] == r.sizes[dt], out
            assert "data" not in out, out
        r.check_outputs("http")

        # gRPC, registered over gRPC; the output region cleared first.
        shm.set_shared_memory_region(r.out, [np.zeros(r.total, np.uint8)])
        grpc.unregister_system_shared_memory(headers=GH)
        assert grpc.get_system_shared_memory_status(headers=GH, as_json=True) == {}
        grpc.register_system_shared_memory(r.in_name, r.in_key, r.total, headers=GH)
        grpc.register_system_shared_memory(r.out_name, r.out_key, r.total, headers=GH)
        regions = grpc.get_system_shared_memory_status(headers=GH, as_json=True)["regions"]
        assert set(regions) == {r.in_name, r.out_name}
        inputs, outputs = [], []
        for dt, a in data.items():
            i = grpcclient.InferInput(f"INPUT_{dt}", list(a.shape), dt)
            i.set_shared_memory(r.in_name, r.sizes[dt], offset=r.offsets[dt])
            inputs.append(i)
            o = grpcclient.InferRequestedOutput(f"OUTPUT_{dt}")
            o.set_shared_memory(r.out_name, r.sizes[dt], offset=r.offsets[dt])
            outputs.append(o)
        res = grpc.infer("dtypes", inputs, outputs=outputs, headers=GH)
        for dt in data:
            assert res.get_output(f"OUTPUT_{dt}").parameters["shared_memory_region"].string_param == r.out_name
        r.check_outputs("grpc")
        # Mixed: some inputs in shared memory, the others in the request.
        inputs = []
        for k, (dt, a) in enumerate(data.items()):
            i = grpcclient.InferInput(f"INPUT_{dt}", list(a.shape), dt)
            if k % 2:
                i.set_shared_memory(r.in_name, r.sizes[dt], offset=r.offsets[dt])
            else:
                i.set_data_from_numpy(a)
            inputs.append(i)
        res = grpc.infer("dtypes", inputs, headers=GH)
        for dt, a in data.items():
            assert_tensor_equal(dt, res.as_numpy(f"OUTPUT_{dt}"), np.flip(a, axis=-1), f"mixed {dt}")
    finally:
        http.unregister_system_shared_memory(headers=HH)
        r.close()
    assert http.get_system_shared_memory_status(headers=HH) == []


_SMALL = dtypes_data(shape=(1, 4), seed=91)


def _one_input(http_or_grpc, region: str, size: int, offset: int = 0):
    """Every input of the dtypes model, INPUT_FP32 ([1, 4]) from the shared-memory slice, the
    others in the request."""
    mod = httpclient if http_or_grpc == "http" else grpcclient
    inputs = []
    for dt, a in _SMALL.items():
        i = mod.InferInput(f"INPUT_{dt}", list(a.shape), dt)
        if dt == "FP32":
            i.set_shared_memory(region, size, offset=offset)
        elif http_or_grpc == "http":
            i.set_data_from_numpy(a, binary_data=True)
        else:
            i.set_data_from_numpy(a)
        inputs.append(i)
    return inputs


def test_shared_memory_refuses_lies_strangers_and_vanishing_objects(server, http, grpc):
    u = uuid.uuid4().hex[:8]
    key, name = f"/alice-lies-{u}", f"lies-{u}"
    h = shm.create_shared_memory_region(name, key, 64)
    try:
        shm.set_shared_memory_region(h, [np.arange(16, dtype=np.float32)])
        # Registration that lies about the object: past its end, overflowing, no such key.
        for off, size in ((0, 65), (60, 8), (2**63, 2**63)):
            with pytest.raises(InferenceServerException):
                http.register_system_shared_memory(name, key, size, offset=off, headers=HH)
        with pytest.raises(InferenceServerException, match="Unable to open"):
            http.register_system_shared_memory(name, f"/alice-nothing-{u}", 8, headers=HH)
        for bad_key in ("/alice-../../etc/passwd", "alice-noslash", "/alice-a/b"):
            with pytest.raises(InferenceServerException):
                http.register_system_shared_memory(name, bad_key, 8, headers=HH)
        # Another tenant's prefix: bob may not register alice's object.
        with pytest.raises(InferenceServerException, match="may register only"):
            http.register_system_shared_memory(name, key, 64, headers=BOB_H)
        with pytest.raises(InferenceServerException) as e:
            grpc.register_system_shared_memory(name, key, 64, headers=BOB_G)
        assert "PERMISSION_DENIED" in str(e.value.status())
        # A symbolic link under alice's prefix to bob's object is not followed.
        bob_key = f"/bob-secret-{u}"
        hb = shm.create_shared_memory_region(f"b-{u}", bob_key, 64)
        link = f"/dev/shm/alice-link-{u}"
        os.symlink(f"/dev/shm{bob_key}", link)
        try:
            with pytest.raises(InferenceServerException, match="Unable to open"):
                http.register_system_shared_memory(f"link-{u}", f"/alice-link-{u}", 8, headers=HH)
        finally:
            os.unlink(link)
            shm.destroy_shared_memory_region(hb)

        http.register_system_shared_memory(name, key, 64, headers=HH)
        with pytest.raises(InferenceServerException, match="already in manager"):
            http.register_system_shared_memory(name, key, 64, headers=HH)
        # Bob does not see alice's region, by status or by use.
        assert http.get_system_shared_memory_status(headers=BOB_H) == []
        with pytest.raises(InferenceServerException, match="Unable to find"):
            http.get_system_shared_memory_status(region_name=name, headers=BOB_H)
        with pytest.raises(InferenceServerException, match="Unable to find"):
            http.infer("dtypes", _one_input("http", name, 16), headers=BOB_H)
        # Slices that lie: outside the region, a size the shape does not match.
        for door, client, hdr in (("http", http, HH), ("grpc", grpc, GH)):
            for size, off, says in (
                (16, 56, "outside region"),
                (16, 2**62, "outside region"),
                (12, 0, "needs 16"),
                (64, 0, "needs 16"),
            ):
                with pytest.raises(InferenceServerException) as e:
                    client.infer("dtypes", _one_input(door, name, size, off), headers=hdr)
                assert says in e.value.message(), (door, size, off, e.value.message())
                assert str(e.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT"), e.value
        # An output slice smaller than the output.
        o = httpclient.InferRequestedOutput("OUTPUT_FP32", binary_data=True)
        o.set_shared_memory(name, 8, offset=0)
        with pytest.raises(InferenceServerException, match="needs 16 bytes"):
            http.infer("dtypes", _one_input("http", name, 16), outputs=[o], headers=HH)
        # The client truncates its object under the registered region: a 400, no crash.
        os.truncate(f"/dev/shm{key}", 8)
        with pytest.raises(InferenceServerException, match="truncated"):
            http.infer("dtypes", _one_input("http", name, 16, 16), headers=HH)
        # ... or unlinks it: the registered region still reads what the object held.
        os.truncate(f"/dev/shm{key}", 64)
        shm.set_shared_memory_region(h, [np.arange(16, dtype=np.float32)])
        os.unlink(f"/dev/shm{key}")
        res = http.infer("dtypes", _one_input("http", name, 16, 16), headers=HH)
        np.testing.assert_array_equal(res.as_numpy("OUTPUT_FP32"), [[7, 6, 5, 4]])
        # Unregistered: unknown from then on.
        http.unregister_system_shared_memory(name, headers=HH)
        with pytest.raises(InferenceServerException, match="Unable to find"):
            http.infer("dtypes", _one_input("http", name, 16), headers=HH)
    finally:
        http.unregister_system_shared_memory(headers=HH)
        try:
            shm.destroy_shared_memory_region(h)
        except Exception:  # noqa: BLE001 - unlinked by the test already
            pass
    # CUDA shared memory is refused, with a reason, on both doors.
    r = request(server, "POST", "/v2/cudasharedmemory/region/x/register", {"raw_handle": {"b64": ""}, "device_id": 0, "byte_size": 8}, headers=HH)
    assert r.status == 400 and "CUDA shared memory is not supported" in r.json()["error"], r
    with grpc_lib.insecure_channel(f"{server.host}:{server.grpc_port}") as ch:
        with pytest.raises(grpc_lib.RpcError) as e:
            pb_grpc.GRPCInferenceServiceStub(ch).CudaSharedMemoryRegister(
                pb.CudaSharedMemoryRegisterRequest(name="x", byte_size=8), metadata=tuple(GH.items()), timeout=30
            )
    assert e.value.code() == grpc_lib.StatusCode.INVALID_ARGUMENT
    assert "CUDA shared memory is not supported" in e.value.details()
    # What Triton's shared-memory examples call first to clean up, and the status: answered as
    # Triton answers them with no CUDA region registered (none is, ever), on both doors.
    grpc = grpcclient.InferenceServerClient(f"{server.host}:{server.grpc_port}")
    http.unregister_cuda_shared_memory(headers=HH)
    http.unregister_cuda_shared_memory("x", headers=HH)
    grpc.unregister_cuda_shared_memory(headers=GH)
    grpc.unregister_cuda_shared_memory("x", headers=GH)
    assert http.get_cuda_shared_memory_status(headers=HH) == []
    assert not grpc.get_cuda_shared_memory_status(headers=GH, as_json=True).get("regions")
    for call in (
        lambda: http.get_cuda_shared_memory_status("x", headers=HH),
        lambda: grpc.get_cuda_shared_memory_status("x", headers=GH),
    ):
        with pytest.raises(InferenceServerException, match="Unable to find cuda shared memory region: 'x'"):
            call()
    # Not without a token.
    assert request(server, "POST", "/v2/cudasharedmemory/unregister", {}).status == 401
    assert request(server, "GET", "/v2/cudasharedmemory/status").status == 401
    assert http.is_server_live()


def test_regions_unregistered_while_requests_use_them(server, http):
    """Requests race a region's unregister and re-register: each answers with the right values
    or with "Unable to find", never with other bytes, and the daemon stays up."""
    import threading

    u = uuid.uuid4().hex[:8]
    key, name = f"/alice-race-{u}", f"race-{u}"
    h = shm.create_shared_memory_region(name, key, 64)
    x = np.arange(16, dtype=np.float32)
    shm.set_shared_memory_region(h, [x])
    http.register_system_shared_memory(name, key, 64, headers=HH)
    stop = threading.Event()
    results: list[str] = []

    def flip():
        # Its own HTTP connections (tritonclient's HTTP client is gevent's: one thread).
        base = f"/v2/systemsharedmemory/region/{name}"
        while not stop.is_set():
            request(server, "POST", f"{base}/unregister", {}, headers=HH)
            request(server, "POST", f"{base}/register", {"key": key, "offset": 0, "byte_size": 64}, headers=HH)

    t = threading.Thread(target=flip)
    t.start()
    try:
        for _ in range(60):
            try:
                res = http.infer("dtypes", _one_input("http", name, 16, 16), headers=HH)
                np.testing.assert_array_equal(res.as_numpy("OUTPUT_FP32"), [[7, 6, 5, 4]])
                results.append("ok")
            except InferenceServerException as e:
                assert "Unable to find" in e.message(), e.message()
                results.append("unknown")
    finally:
        stop.set()
        t.join()
        http.unregister_system_shared_memory(headers=HH)
        shm.destroy_shared_memory_region(h)
    assert "ok" in results, results
    assert http.is_server_live()
