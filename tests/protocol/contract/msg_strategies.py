"""Hypothesis strategies for every wire message and payload, with every payload encoding."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol.contract.codec import Envelope
from protocol.contract.messages import (
    Ack,
    Capabilities,
    Chunk,
    ChunkRequest,
    CoordinatorState,
    ErrorReply,
    Fetch,
    InputSpec,
    Knowledge,
    Progress,
    Register,
    Reply,
    RoundDescriptor,
    Status,
    Task,
)
from protocol.contract.payloads import (
    ClassStats,
    FeatureLogitSet,
    ImageVectorPairs,
    PrototypeSet,
    TensorMap,
)

# msgpack cannot carry lone surrogates; ids and names stay within the validators' limits
chars = st.characters(blacklist_categories=["Cs"])
text = st.text(chars, max_size=20)
names = st.text(chars, min_size=1, max_size=24)
ids = st.from_regex(r"[A-Za-z0-9_.-]{1,16}", fullmatch=True)
counts = st.integers(0, 10_000)
small_ints = st.integers(0, 2**31 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
times = st.floats(0, 4e9, allow_nan=False)
dims = st.integers(1, 6)
rows = st.integers(0, 5)


def f32(shape: Any, bound: float = 1e4) -> st.SearchStrategy[np.ndarray]:
    """float32 arrays with values in [-bound, bound] (within float16 range for f16 tests)."""
    return hnp.arrays(np.float32, shape, elements=st.floats(-bound, bound, width=32))


@st.composite
def class_ids(draw: st.DrawFn, m: int, below: int = 1000) -> np.ndarray:
    return np.array(
        draw(st.lists(st.integers(0, below - 1), min_size=m, max_size=m, unique=True)),
        dtype=np.int32,
    )


@st.composite
def prototype_sets(draw: st.DrawFn) -> PrototypeSet:
    m, d = draw(rows), draw(dims)
    sd = draw(st.none() | hnp.arrays(np.float32, (d,), elements=st.floats(0.125, 1024.0, width=32)))
    return PrototypeSet(
        class_ids=draw(class_ids(m)),
        vectors=draw(f32((m, d))),
        counts=np.array(draw(st.lists(counts, min_size=m, max_size=m)), dtype=np.int32),
        sd=sd,
        encoding=draw(st.sampled_from(["raw", "f16"])),
    )


@st.composite
def feature_logit_sets(draw: st.DrawFn) -> FeatureLogitSet:
    m, d, c = draw(rows), draw(dims), draw(st.integers(1, 8))
    m = min(m, c)
    return FeatureLogitSet(
        class_ids=draw(class_ids(m, below=c)),
        features=draw(f32((m, d))),
        logits=draw(f32((m, c))),
        counts=np.array(draw(st.lists(counts, min_size=m, max_size=m)), dtype=np.int32),
        encoding=draw(st.sampled_from(["raw", "f16"])),
    )


@st.composite
def class_stats(draw: st.DrawFn) -> ClassStats:
    m, d = draw(rows), draw(st.integers(1, 4))
    a = draw(f32((m, d, d))).astype(np.float64) / 256  # product stays in float32 range
    cov = a @ a.transpose(0, 2, 1)  # exactly symmetric after averaging with its transpose
    return ClassStats(
        class_ids=draw(class_ids(m)),
        means=draw(f32((m, d))),
        covariances=((cov + cov.transpose(0, 2, 1)) / 2).astype(np.float32),
        counts=np.array(draw(st.lists(st.integers(1, 10**6), min_size=m, max_size=m)), np.int32),
        encoding=draw(st.sampled_from(["raw", "f16"])),
    )


@st.composite
def image_vector_pairs(draw: st.DrawFn) -> ImageVectorPairs:
    n = draw(rows)
    images = draw(hnp.arrays(np.uint8, (n, draw(st.integers(1, 3)), draw(dims), draw(dims))))
    ids = draw(st.none() | st.permutations(range(n + 2)).map(lambda p: np.array(p[:n], np.int32)))
    return ImageVectorPairs(
        images=images,
        vectors=draw(f32((n, draw(dims)))),
        class_ids=ids,
        round=draw(st.integers(0, 2**31)),
        encoding=draw(st.sampled_from(["raw", "f16"])),
    )


@st.composite
def tensor_maps(draw: st.DrawFn) -> TensorMap:
    shapes = hnp.array_shapes(min_dims=0, max_dims=3, max_side=5)
    tensor = st.one_of(
        hnp.arrays(np.float32, shapes, elements=st.floats(-6e4, 6e4, width=32)),
        hnp.arrays(np.int64, shapes, elements=st.integers(-(2**40), 2**40)),
        hnp.arrays(np.bool_, shapes),
    )
    tensors = draw(
        st.dictionaries(st.from_regex(r"[a-z][a-z0-9_.]{0,12}", fullmatch=True), tensor, max_size=4)
    )
    return TensorMap(tensors=tensors, encoding=draw(st.sampled_from(["raw", "f16", "i8"])))


payloads = st.one_of(
    prototype_sets(), feature_logit_sets(), class_stats(), image_vector_pairs(), tensor_maps()
)
payload_maps = st.dictionaries(ids, payloads, max_size=2)
scalars = st.one_of(st.booleans(), st.integers(-(2**62), 2**62), finite, text)


@st.composite
def registers(draw: st.DrawFn) -> Register:
    k = draw(st.integers(1, 20))
    cc = draw(st.dictionaries(st.integers(0, k - 1).map(str), counts, max_size=k))
    # the class-set form (a run that does not read the label histogram) or the counts
    present = [] if cc else sorted(draw(st.sets(st.integers(0, k - 1), max_size=k)))
    total = draw(st.integers(len(present), 2**31)) if present else 0
    return Register(
        device_id=draw(names),
        arch=draw(names),
        num_params=draw(small_ints),
        capabilities=Capabilities(
            device=draw(st.sampled_from(["cpu", "cuda"])),
            accelerator=draw(text),
            memory_mb=draw(small_ints),
            cpu_count=draw(st.integers(1, 256)),
        ),
        input_spec=InputSpec(
            channels=draw(st.integers(1, 4)),
            height=draw(st.integers(1, 512)),
            width=draw(st.integers(1, 512)),
        ),
        num_classes=k,
        class_counts=cc,
        algorithm=draw(names),
        agent_version=draw(text),
        classes=present,
        num_samples=total,
    )


def _task(draw: st.DrawFn) -> Task:
    return Task(
        task_id=draw(names),
        run_id=draw(text),
        round=draw(small_ints),
        phase=draw(names),
        deadline=draw(times),
        algorithm=draw(names),
        config=draw(st.dictionaries(ids, scalars, max_size=4)),
        payloads=draw(payload_maps),
        shared=draw(st.sampled_from([b""]) | st.binary(min_size=32, max_size=32)),
    )


def _knowledge(draw: st.DrawFn) -> Knowledge:
    return Knowledge.of(draw(small_ints), draw(payload_maps))


def _reply(draw: st.DrawFn) -> Reply:
    return Reply(
        task_id=draw(names),
        round=draw(small_ints),
        phase=draw(text),
        num_samples=draw(small_ints),
        payloads=draw(payload_maps),
        metrics=draw(st.dictionaries(ids, finite, max_size=4)),
    )


digests = st.binary(min_size=32, max_size=32)


@st.composite
def chunks(draw: st.DrawFn) -> Chunk:
    count = draw(st.integers(1, 100))
    return Chunk(
        digest=draw(digests),
        index=draw(st.integers(0, count - 1)),
        count=count,
        total_size=draw(small_ints),
        data=draw(st.binary(max_size=64)),
    )


@st.composite
def messages(draw: st.DrawFn) -> Any:
    """One message of any kind."""
    kind = draw(st.sampled_from(sorted(BUILDERS)))
    return draw(BUILDERS[kind])


BUILDERS: dict[str, st.SearchStrategy[Any]] = {
    "register": registers(),
    "status": st.builds(
        Status, state=st.sampled_from(["online", "offline", "busy", "done"]), detail=text
    ),
    "coord_state": st.builds(
        CoordinatorState,
        state=st.sampled_from(["starting", "running", "finished", "offline"]),
        run_id=text,
        algorithm=text,
        round=small_ints,
        total_rounds=small_ints,
        class_counts=st.booleans(),
    ),
    "round": st.builds(
        RoundDescriptor,
        run_id=text,
        round=small_ints,
        phase=text,
        deadline=times,
        selected=st.lists(ids, max_size=4),
    ),
    "task": st.composite(_task)(),
    "reply": st.composite(_reply)(),
    "error": st.builds(ErrorReply, code=text, reason=text, task_id=text, ref_id=text),
    "ack": st.builds(Ack, ref_id=text, task_id=text, accepted=st.booleans(), reason=text),
    "progress": st.builds(
        Progress,
        task_id=text,
        round=small_ints,
        phase=text,
        step=small_ints,
        total=small_ints,
        loss=finite,
        samples_per_s=finite,
    ),
    "chunk": chunks(),
    "chunk_req": st.builds(
        ChunkRequest, digest=digests, missing=st.lists(st.integers(0, 2**31), max_size=8)
    ),
    "knowledge": st.composite(_knowledge)(),
    "fetch": st.builds(Fetch, digest=digests),
}


@st.composite
def envelopes(draw: st.DrawFn, body: st.SearchStrategy[Any] | None = None) -> Envelope:
    """An envelope around ``body`` (default: any message) with random routing metadata."""
    return Envelope(
        body=draw(body if body is not None else messages()),
        sender=draw(names),
        federation=draw(names),
        round=draw(small_ints),
        msg_id=draw(st.from_regex(r"[0-9a-f]{1,32}", fullmatch=True)),
        ts=draw(times),
    )
