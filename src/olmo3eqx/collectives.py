"""Every collective of one compiled step, counted and sized from the program's text: what crosses which link.

`account(compiled.as_text(), mesh, granules)` reads the partitioned HLO (after SPMD partitioning, as XLA:CPU,
XLA:GPU and XLA:TPU print it) and returns a `Traffic`: each all-gather, reduce-scatter, all-reduce, all-to-all and
collective-permute with its dtypes, how often one step runs it, the mesh axes its groups span and whether a group
spans more than one granule (a node or a TPU slice: `granules`, shaped like mesh.devices).

- Counting. A loop body runs its trip count times and nested loops multiply (the layer scan inside gradient
  accumulation, the chunked loss). The trip count is the compiler's `known_trip_count` where it states one (XLA:CPU,
  XLA:GPU), else read from the loop's condition (`i < N` against a constant, with the induction variable's constant
  start and step: XLA:TPU states no trip count); a loop neither gives is counted once and marked unknown, never
  guessed. Fusions, calls and async wrappers run where they are called; the branches of a conditional are each
  counted as if taken (an upper bound, marked). An async pair (`all-gather-start` / `-done`, `async-start` /
  `-done`) counts once, and so does XLA:TPU's async collective fusion (a start, continuations and a done fusion, each
  holding a copy of the collective: the start's is counted). XLA:TPU's reduce-scatter, a fusion that slices this
  device's part out of an all-reduce (`all-reduce-scatter`), counts as the reduce-scatter it runs as, and so does an
  all-reduce whose every user slices a part out of it (the program as partitioned, read on CPU devices before
  XLA:CPU's own passes: XLA:GPU's reduce-scatter creator makes it a reduce-scatter). An all-reduce of zero-padded
  parts (each device's part written into a broadcast zero: XLA:TPU's way of running some all-gathers) counts as an
  all-gather, with the all-reduce's bytes.
- Groups. Replica groups come as lists (`{{0,1},{2,3}}`), iota (`[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)`) or mesh-axes
  form (`mesh['axis_0'=2,'axis_1'=4], device_ids=(...) {'axis_1'}`, sub-axes `'axis_0':(2)2`); with
  use_global_device_ids the ids are partition ids, the positions in `mesh.devices.flat` (tests/test_collectives.py
  checks this against a psum over one axis of a permuted mesh). A collective's axes are the mesh axes whose
  coordinate varies within its groups.
- Bytes (BYTES_CONVENTION). Raw bytes: the buffer the collective works on (all-gather its output, reduce-scatter
  its input, the rest their result), tuple-shaped (combined) collectives summed with a split by dtype, logical
  sizes (a TPU layout's tile padding not counted). Bytes per device: what each device sends in the ring algorithm,
  with n the group size: all-gather and all-to-all (n-1)/n of the raw bytes, reduce-scatter (n-1)/n, all-reduce
  2(n-1)/n, a collective-permute the whole buffer. Other algorithms (trees, NVLS, in-network reductions) move other
  amounts; the ring's is the usual bandwidth-bound figure.
- Summary. The table's rows sum a step's collectives by kind, dtype, mesh axes and link; below them `by_axes` sums
  each set of mesh axes per link (what a context axis alone sends, `context`, apart from the weights' gathers over
  `fsdp,context`; the data axis's gradient reduction across nodes).
- Several TPU slices. XLA:TPU compiles a multislice step as each slice's program: its collectives' groups name the
  slice's own devices (partition ids 0..devices per slice - 1, read as the first slice's positions in the mesh), and
  what crosses the data-centre network is host transfers to the Megascale runtime (`send` with
  `_xla_megascale_transfer_type`, the collective it serves: ALL_GATHER, ALL_REDUCE, ...). Each such send is counted
  as kind `dcn-send` (DCN_KIND), across granules, its bytes the buffer the device hands over (factor 1), its axes
  the mesh axes along which the granules change (the data axis on a mesh whose data axis runs across slices).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "dcn-send")
DCN_KIND = "dcn-send"
"""A multislice program's host transfer to the Megascale runtime over the data-centre network (module doc)."""
MIB = 2**20
BYTES_CONVENTION = ("what each device sends, ring algorithm over a group of n: all-gather (n-1)/n x output, "
                    "reduce-scatter (n-1)/n x input, all-reduce 2(n-1)/n, all-to-all (n-1)/n, collective-permute 1 x "
                    "the buffer")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
               "f4e2m1fn": 0.5}
"""Bytes per element by HLO element type; every f8 type (f8e4m3fn, f8e5m2, ...) is 1."""

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_OPCODE = re.compile(r"^(" + "|".join(KINDS) + r")(-start|-done)?$")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ASYNC_FLAGS = re.compile(r'"async_collective_fusion_config":\{"flag_start":"(-?\d+)"')
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')
_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_LIST_GROUPS = re.compile(r"replica_groups=(\{(?:\{[\d,\s]*\},?\s*)*\})")
_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]+)\))?"
                          r" \{([^}]*)\}")
_MAXIMAL = re.compile(r"replica_groups=maximal_mesh\[")
_PAIRS = re.compile(r"source_target_pairs=(\{(?:\{\d+,\d+\},?)*\})")
ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
"""One array in a shape's text: its element type and its dimensions (`bf16[4,8192]`)."""


class HloParseError(ValueError):
    """The program's text is not what account() understands (a replica-group form or shape it cannot read)."""


@dataclass(frozen=True)
class Collective:
    """One collective instruction of the step."""

    kind: str
    """all-gather, reduce-scatter, all-reduce, all-to-all or collective-permute (async forms under their kind), or
    dcn-send (a multislice program's transfer over the data-centre network)."""
    name: str
    computation: str
    raw: dict[str, float]
    """Raw bytes by dtype (module doc): all-gather output, reduce-scatter input, otherwise the result."""
    group_size: int
    axes: tuple[str, ...]
    """Mesh axes whose coordinate varies within a group (empty: groups of one device, nothing sent)."""
    across: bool
    """Some group (or permute pair) holds devices of more than one granule."""
    count: int
    """Runs per step; a lower bound when `exact` says so."""
    exact: str = "exact"
    """"exact", "unknown" (inside a loop whose trip count neither the compiler nor its condition states: counted as
    one trip) or "at most" (inside a conditional's branch)."""
    as_all_reduce: bool = False
    """An all-gather XLA:TPU runs as an all-reduce of zero-padded parts (sized as the all-reduce it runs as)."""

    @property
    def factor(self) -> float:
        """Bytes each device sends per raw byte (the ring algorithm, BYTES_CONVENTION)."""
        n = self.group_size
        if self.kind == DCN_KIND:
            return 1.0
        if self.kind == "collective-permute":
            return 1.0 if self.axes else 0.0
        if n <= 1:
            return 0.0
        return (2 * (n - 1) / n) if self.kind == "all-reduce" or self.as_all_reduce else (n - 1) / n

    @property
    def bytes_per_device(self) -> float:
        """Bytes each device sends in one run."""
        return self.factor * sum(self.raw.values())


@dataclass(frozen=True)
class Row:
    """Collectives of one kind, dtype, mesh axes and link, summed over a step."""

    kind: str
    dtype: str
    axes: tuple[str, ...]
    across: bool
    count: int
    bytes_per_device: float
    raw_bytes: float
    exact: str

    @property
    def link(self) -> str:
        return "across" if self.across else "within"


@dataclass(frozen=True)
class Traffic:
    """The collectives of one step and their summary (see the module doc for the conventions)."""

    collectives: tuple[Collective, ...]
    granules: int = 1
    """Granules (nodes or slices) the mesh spans."""
    rows: tuple[Row, ...] = field(init=False)

    def __post_init__(self):
        sums: dict[tuple, list] = {}
        for c in self.collectives:
            for dtype, raw in c.raw.items():
                key = (c.kind, dtype, c.axes, c.across)
                entry = sums.setdefault(key, [0, 0.0, 0.0, "exact"])
                entry[0] += c.count
                entry[1] += c.count * c.factor * raw
                entry[2] += c.count * raw
                entry[3] = _weaker(entry[3], c.exact)
        rows = tuple(Row(k[0], k[1], k[2], k[3], *v) for k, v in sorted(
            sums.items(), key=lambda kv: (kv[0][3], KINDS.index(kv[0][0]), kv[0][2], kv[0][1])))
        object.__setattr__(self, "rows", rows)

    def total(self, across: bool) -> float:
        """Bytes each device sends per step within granules (across=False) or across them."""
        return float(sum(r.bytes_per_device for r in self.rows if r.across == across))

    def by_axes(self) -> dict[tuple[str, ...], tuple[float, float]]:
        """Bytes each device sends per step (within granules, across them) by the mesh axes a collective's groups
        span, each set of axes once (`("context",)`: what the context axis alone carries, the keys' and values'
        gathers; `("fsdp", "context")`: the weights' gathers over both), sets that send nothing left out."""
        out: dict[tuple[str, ...], list[float]] = {}
        for r in self.rows:
            if r.bytes_per_device:
                out.setdefault(r.axes, [0.0, 0.0])[r.across] += r.bytes_per_device
        return {axes: (within, across) for axes, (within, across) in out.items()}

    @property
    def unknown(self) -> tuple[Collective, ...]:
        """Collectives whose count is not exact."""
        return tuple(c for c in self.collectives if c.exact != "exact")

    def to_json(self) -> dict:
        """A JSON-able summary: the convention, one entry per row, the totals and what is not exact."""
        return {"convention": BYTES_CONVENTION, "granules": self.granules,
                "rows": [{"kind": r.kind, "dtype": r.dtype, "axes": list(r.axes), "link": r.link, "count": r.count,
                          "bytes_per_device": r.bytes_per_device, "raw_bytes": r.raw_bytes, "count_is": r.exact}
                         for r in self.rows],
                "within_bytes_per_device": self.total(False), "across_bytes_per_device": self.total(True),
                "by_axes": [{"axes": list(axes), "within_bytes_per_device": within, "across_bytes_per_device": across}
                            for axes, (within, across) in self.by_axes().items()],
                "not_exact": [{"name": c.name, "kind": c.kind, "count_is": c.exact} for c in self.unknown]}

    def lines(self, links: tuple[str, str] = ("within node/slice", "across nodes/slices")) -> list[str]:
        """The table the dry run prints; `links` names the link within a granule and across (GPU nodes: NVLink and
        the network)."""
        out = [f"collectives per step:  {len(self.collectives)} instructions; MiB/device = {BYTES_CONVENTION}"]
        if not self.rows:
            return out + ["  none"]
        out.append(f"  {'kind':<19}{'dtype':<7}{'axes':<17}{'link':<20}{'count':>7}{'MiB/device':>13}")
        for r in self.rows:
            count = f"{'>=' if r.exact == 'unknown' else '<=' if r.exact == 'at most' else ''}{r.count}"
            link = links[1] if r.across else links[0]
            out.append(f"  {r.kind:<19}{r.dtype:<7}{','.join(r.axes) or '-':<17}{link:<20}{count:>7}"
                       f"{r.bytes_per_device / MIB:>13,.2f}")
        out.append(f"  total per device per step: {self.total(False) / MIB:,.2f} MiB within a node/slice, "
                   f"{self.total(True) / MIB:,.2f} MiB across ({self.granules} node(s)/slice(s) in the mesh)")
        out.append(f"  {'by mesh axes':<43}{'MiB/device within':>20}{'across':>13}")
        for axes, (within, across) in self.by_axes().items():
            out.append(f"  {','.join(axes):<43}{within / MIB:>20,.2f}{across / MIB:>13,.2f}")
        unknown = [c for c in self.unknown if c.exact == "unknown"]
        if unknown:
            out.append(f"  >= : {len(unknown)} collectives sit in loops whose trip count neither the compiler nor the "
                       f"loop's condition states; counted as one trip")
        if any(c.exact == "at most" for c in self.unknown):
            out.append("  <= : collectives in a conditional's branches, each counted as if taken")
        return out


def _weaker(a: str, b: str) -> str:
    order = ("exact", "at most", "unknown")
    return max(a, b, key=order.index)


@dataclass
class Instruction:
    """One instruction of a program's text: its name, opcode, result shape, operand and attribute text, and whether
    it is its computation's root (what olmo3eqx.gpu_estimate reads too)."""

    name: str
    op: str
    shape: str
    args: str
    attrs: str
    root: bool


def _split_call(rest: str) -> tuple[str, str]:
    """(operands, attributes) of the text after an opcode's opening parenthesis."""
    depth = 1
    for i, ch in enumerate(rest):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return rest[:i], rest[i + 1:]
    raise HloParseError(f"unbalanced operand list: {rest[:120]!r}")


def parse_program(text: str) -> tuple[dict[str, list[Instruction]], dict[str, Instruction], str]:
    """(instructions by computation, every instruction by its name, the ENTRY computation's name) of a program's text
    (compiled.as_text(): instruction names are unique across the module)."""
    computations: dict[str, list[Instruction]] = {}
    by_name: dict[str, Instruction] = {}
    entry = None
    current: list[Instruction] | None = None
    for line in text.splitlines():
        if not line or line[0] not in " \t":
            header = _HEADER.match(line)
            if header:
                current = computations.setdefault(header.group(1), [])
                if line.startswith("ENTRY"):
                    entry = header.group(1)
            continue
        found = _INSTRUCTION.match(line)
        if found is None or current is None:
            continue
        root, name, shape, op, rest = found.groups()
        args, attrs = _split_call(rest)
        inst = Instruction(name, op, shape, args, attrs, root is not None)
        current.append(inst)
        by_name[name] = inst
    if entry is None:
        raise HloParseError("no ENTRY computation: pass the text of a compiled program (compiled.as_text()).")
    return computations, by_name, entry


def operand_names(inst: Instruction) -> list[str]:
    """Names of the instructions `inst` takes as operands."""
    return re.findall(r"%([\w.\-]+)", inst.args)


def called_computations(inst: Instruction) -> list[tuple[str, str]]:
    """(role, computation) pairs `inst` calls: calls, body, condition, to_apply, a conditional's branches."""
    out = _CALLED.findall(inst.attrs)
    for group in _BRANCHES.findall(inst.attrs):
        out += [("branch", name.strip().lstrip("%")) for name in group.split(",") if name.strip()]
    return out


# ---- shapes ----------------------------------------------------------------------------------------------------

def shape_tree(shape: str):
    """'(f32[2]{0}, (bf16[3,4], s32[]))' -> nested lists of (dtype, elements)."""
    text = re.sub(r"/\*.*?\*/", "", shape)
    text = re.sub(r"\{[^{}]*\}", "", text)
    pos = 0

    def parse():
        nonlocal pos
        while text[pos] == " ":
            pos += 1
        if text[pos] == "(":
            pos += 1
            items = []
            while True:
                while text[pos] in " ,":
                    pos += 1
                if text[pos] == ")":
                    pos += 1
                    return items
                items.append(parse())
        found = ARRAY.match(text, pos)
        if found is None:
            if text.startswith("token[]", pos) or text.startswith("token", pos):
                pos += len("token")
                return ("token", 0)
            raise HloParseError(f"cannot read the shape {shape!r}")
        pos = found.end()
        dims = [int(d.lstrip("<=")) for d in found.group(2).split(",") if d.strip()]
        return (found.group(1), math.prod(dims))

    return parse()


def _dtype_bytes(dtype: str) -> float:
    if dtype.startswith("f8"):
        return 1.0
    if dtype not in DTYPE_BYTES:
        raise HloParseError(f"unknown element type {dtype!r} in the program's text; add it to DTYPE_BYTES.")
    return float(DTYPE_BYTES[dtype])


def bytes_by_dtype(tree) -> dict[str, float]:
    """Bytes by element type of a shape_tree (tokens count none)."""
    out: dict[str, float] = defaultdict(float)

    def walk(t):
        if isinstance(t, list):
            for item in t:
                walk(item)
        elif t[0] != "token":
            out[t[0]] += t[1] * _dtype_bytes(t[0])

    walk(tree)
    return dict(out)


def _result(kind: str, start: bool, shape: str):
    """The shape of the collective's result: an async start's tuple holds (operands, results[, contexts])."""
    tree = shape_tree(shape)
    if start and kind != "all-reduce":
        if not isinstance(tree, list) or len(tree) < 2:
            raise HloParseError(f"unexpected {kind}-start shape {shape!r}")
        return tree[1]
    return tree


# ---- groups ----------------------------------------------------------------------------------------------------

def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _mesh_groups(axes_text: str, ids_text: str | None, refs_text: str) -> list[np.ndarray]:
    """Replica groups of XLA's mesh-axes form (MeshAxesReplicaGroupList)."""
    names, sizes = [], []
    for name, size in re.findall(r"'?([\w.\-]+)'?=(\d+)", axes_text):
        names.append(name)
        sizes.append(int(size))
    total = math.prod(sizes)
    if ids_text is None:
        devices = np.arange(total)
    elif ids_text.startswith("["):
        dims_text, _, perm_text = ids_text.partition("T")
        reshape = _ints(dims_text)
        perm = _ints(perm_text) if perm_text else list(range(len(reshape)))
        devices = np.arange(total).reshape(reshape).transpose(perm).reshape(-1)
    else:
        devices = np.asarray(_ints(ids_text))
    refs: list[tuple[int, int | None, int | None]] = []
    for name, pre, size in re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", refs_text):
        if name not in names:
            raise HloParseError(f"replica group axis {name!r} is not in mesh[{axes_text}]")
        refs.append((names.index(name), int(pre) if pre else None, int(size) if size else None))
    # Split each mesh axis into the sub-axes the refs name (as XLA does), then put the grouped ones last.
    dims: list[int] = []
    grouped_at: dict[int, int] = {}
    for axis, full in enumerate(sizes):
        mine = sorted((r for r in enumerate(refs) if r[1][0] == axis), key=lambda r: r[1][1] or 1)
        if not mine:
            dims.append(full)
            continue
        prefix = 1
        for index, (_, pre, size) in mine:
            pre, size = (pre or 1), (size or full)
            if pre != prefix:
                dims.append(pre // prefix)
                prefix = pre
            grouped_at[index] = len(dims)
            dims.append(size)
            prefix *= size
        if prefix != full:
            dims.append(full // prefix)
    grouped = [grouped_at[i] for i in range(len(refs))]
    order = [d for d in range(len(dims)) if d not in grouped] + grouped
    n = math.prod(dims[d] for d in grouped)
    return list(devices.reshape(dims).transpose(order).reshape(-1, n))


def _groups(attrs: str, partitions: int) -> list[np.ndarray]:
    found = _MESH_GROUPS.search(attrs)
    if found:
        return _mesh_groups(*found.groups())
    found = _IOTA_GROUPS.search(attrs)
    if found:
        shape, reshape, perm = _ints(found.group(1)), _ints(found.group(2)), found.group(3)
        ids = np.arange(math.prod(reshape)).reshape(reshape)
        if perm:
            ids = ids.transpose(_ints(perm))
        return list(ids.reshape(shape))
    found = _LIST_GROUPS.search(attrs)
    if found:
        groups = [np.asarray(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", found.group(1)[1:-1])]
        return groups or [np.arange(partitions)]
    if _MAXIMAL.search(attrs):
        return [np.zeros(1, dtype=int)]
    if "replica_groups=" not in attrs:
        return [np.arange(partitions)]
    raise HloParseError(f"cannot read the replica groups in {attrs[:200]!r}")


# ---- trip counts -----------------------------------------------------------------------------------------------

def _through_copies(name: str, by_name: dict[str, Instruction]) -> Instruction | None:
    inst = by_name.get(name)
    while inst is not None and inst.op in ("copy", "bitcast", "convert", "reshape"):
        ops = operand_names(inst)
        inst = by_name.get(ops[0]) if ops else None
    return inst


def _constant(inst: Instruction | None) -> int | None:
    if inst is None or inst.op != "constant":
        return None
    try:
        return int(inst.args.strip())
    except ValueError:
        return None


def _tuple_index(inst: Instruction | None) -> int | None:
    if inst is None or inst.op != "get-tuple-element":
        return None
    found = re.search(r"index=(\d+)", inst.attrs)
    return int(found.group(1)) if found else None


def _unwrapped(inst: Instruction | None, computations, by_name) -> tuple[str, str, list[Instruction | None]] | None:
    """(opcode, attributes, operands) of `inst`, looking through a fusion that wraps one op of its parameters and
    constants (XLA:CPU wraps a loop's compare and increment so; XLA:GPU fuses the limit's constant in too)."""
    if inst is None:
        return None
    operands = [_through_copies(o, by_name) for o in operand_names(inst)]
    if inst.op != "fusion":
        return inst.op, inst.attrs, operands
    called = dict(called_computations(inst)).get("calls")
    root = next((i for i in computations.get(called, ()) if i.root), None)
    if root is None:
        return None
    inner = [by_name.get(o) for o in operand_names(root)]
    if not all(i is not None and i.op in ("parameter", "constant") for i in inner):
        return None
    return root.op, root.attrs, [operands[int(i.args.strip())] if i.op == "parameter" else i for i in inner]


def trip_count(inst: Instruction, computations, by_name) -> int | None:
    """A while loop's trip count: the compiler's known_trip_count, else `i < N` (or <=, >, >=, !=) in its condition
    with the induction variable's constant start (the while's operand tuple) and step (its body's root tuple)."""
    found = _TRIP.search(inst.attrs)
    if found:
        return int(found.group(1))
    called = dict(called_computations(inst))
    condition, body = computations.get(called.get("condition"), []), computations.get(called.get("body"), [])
    compare = _unwrapped(next((i for i in condition if i.root), None), computations, by_name)
    if compare is None or compare[0] != "compare":
        return None
    direction, ops = re.search(r"direction=(\w+)", compare[1]), compare[2]
    if direction is None or len(ops) != 2:
        return None
    direction = direction.group(1)
    if _constant(ops[0]) is not None:  # N > i  ->  i < N
        ops = ops[::-1]
        direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
    index, limit = _tuple_index(ops[0]), _constant(ops[1])
    if index is None or limit is None:
        return None
    init_tuple = by_name.get(operand_names(inst)[0]) if operand_names(inst) else None
    if init_tuple is None or init_tuple.op != "tuple" or index >= len(operand_names(init_tuple)):
        return None
    start = _constant(_through_copies(operand_names(init_tuple)[index], by_name))
    body_root = next((i for i in body if i.root), None)
    if start is None or body_root is None or body_root.op != "tuple":
        return None
    update = _unwrapped(_through_copies(operand_names(body_root)[index], by_name), computations, by_name)
    if update is None or update[0] not in ("add", "subtract"):
        return None
    terms = update[2]
    step = next((_constant(t) for t in terms if _constant(t) is not None), None)
    if step is None or not any(_tuple_index(t) == index for t in terms):
        return None
    step = -step if update[0] == "subtract" else step
    span = {"LT": limit - start, "LE": limit - start + 1, "GT": start - limit, "GE": start - limit + 1,
            "NE": limit - start}.get(direction)
    if span is None or step == 0:
        return None
    step = abs(step) if direction != "NE" else step
    if direction == "NE" and (span % step or span // step < 0):
        return None
    return max(0, -(-span // step))


# ---- the walk --------------------------------------------------------------------------------------------------

def account(hlo_text: str, mesh, granules: np.ndarray | None = None) -> Traffic:
    """Every collective of the compiled program `hlo_text` (post-partitioning HLO: `compiled.as_text()`) over `mesh`
    (a jax Mesh: its axis names and the shape of its devices are read); `granules`: each device's node or slice id,
    shaped like mesh.devices (None: one granule). Conventions in the module doc."""
    computations, by_name, entry = parse_program(hlo_text)
    shape = tuple(mesh.devices.shape)
    axis_names = tuple(mesh.axis_names)
    partitions = math.prod(shape)
    granule = np.zeros(partitions, dtype=int) if granules is None else np.asarray(granules).reshape(-1)
    if granule.size != partitions:
        raise ValueError(f"granules has {granule.size} entries for a mesh of {partitions} devices; shape it like "
                         f"mesh.devices.")
    has_work = _has_collectives(computations)
    users: dict[str, list[Instruction]] = defaultdict(list)
    for insts in computations.values():
        for inst in insts:
            for operand in operand_names(inst):
                users[operand].append(inst)
    roots = {name: next((i for i in insts if i.root), None) for name, insts in computations.items()}
    found: list[Collective] = []

    granule_axes = tuple(a for a, k in zip(axis_names, range(len(shape)))
                         if (np.diff(granule.reshape(shape), axis=k) != 0).any())

    def visit(name: str, count: int, exact: str):
        for inst in computations.get(name, ()):
            if _dcn_send(inst):
                raw = bytes_by_dtype(shape_tree(inst.shape)[0])
                found.append(Collective(DCN_KIND, inst.name, name, raw, 2, granule_axes, True, count, exact))
                continue
            kind = _OPCODE.match(inst.op)
            if kind is not None:
                if kind.group(2) != "-done" and not _tpu_async_copy(inst, roots[name]):
                    found.append(_collective(inst, kind.group(1), kind.group(2) == "-start", name, count, exact,
                                             _scattered(inst, roots[name]) or _sliced(inst, users), shape,
                                             axis_names, granule, _gathering(inst, computations, by_name, roots)))
                continue
            if inst.op.endswith("-done") or inst.op == "async-update":
                continue
            for role, called in called_computations(inst):
                if called not in has_work or role == "condition" or (role == "to_apply" and inst.op != "call"):
                    continue
                if inst.op == "while":
                    trips = trip_count(inst, computations, by_name)
                    visit(called, count * (trips if trips is not None else 1),
                          exact if trips is not None else "unknown")
                elif role in ("branch", "true_computation", "false_computation"):
                    visit(called, count, _weaker(exact, "at most"))
                else:  # fusions, calls, async wrappers: run where they are called
                    visit(called, count, exact)

    visit(entry, 1, "exact")
    return Traffic(tuple(found), granules=len(np.unique(granule)))


def _has_collectives(computations: dict[str, list[Instruction]]) -> set[str]:
    """Names of the computations that hold a collective or call one that does."""
    calls = {name: {c for inst in insts for _, c in called_computations(inst)} for name, insts in computations.items()}
    work = {name for name, insts in computations.items() if any(_OPCODE.match(i.op) or _dcn_send(i) for i in insts)}
    changed = True
    while changed:
        grown = {name for name, called in calls.items() if called & work}
        changed = not grown <= work
        work |= grown
    return work


def _dcn_send(inst: Instruction) -> bool:
    """A multislice program's send to the Megascale runtime (module doc)."""
    return inst.op == "send" and _MEGASCALE.search(inst.attrs) is not None


def _tpu_async_copy(inst: Instruction, root: Instruction | None) -> bool:
    """XLA:TPU's async collective fusion runs one collective as a start fusion, continuation fusions and a done
    fusion, each holding a copy of it: the copies outside the start say where they sit
    (async_collective_fusion_config flag_start other than -1), and the done's computation ends in the custom call
    AsyncCollectiveDone. Only the start's copy is counted."""
    flags = _ASYNC_FLAGS.search(inst.attrs)
    if flags is not None and flags.group(1) != "-1":
        return True
    target = _CUSTOM_TARGET.search(root.attrs) if root is not None and root.op == "custom-call" else None
    return target is not None and target.group(1) == "AsyncCollectiveDone"


def _scattered(inst: Instruction, root: Instruction | None) -> bool:
    """XLA:TPU prints a reduce-scatter as a fusion (all-reduce-scatter) whose root slices this device's part out of
    an all-reduce; it runs as a reduce-scatter."""
    return (inst.op == "all-reduce" and root is not None and root.op == "dynamic-slice"
            and operand_names(root)[:1] == [inst.name])


def _gathering(inst: Instruction, computations, by_name: dict[str, Instruction], roots) -> bool:
    """XLA:TPU runs some all-gathers as an all-reduce of zero-padded buffers: each device writes its part into zeros
    (a dynamic-update-slice into a broadcast constant, possibly fused) and the sum is the gathered array. Such an
    all-reduce counts as the all-gather it is, with the all-reduce's bytes (what it runs as)."""
    if inst.op != "all-reduce":
        return False
    operands = operand_names(inst)
    return bool(operands) and all(_zero_padded(name, computations, by_name, roots, 0) for name in operands)


def _zero_padded(name: str, computations, by_name: dict[str, Instruction], roots, depth: int,
                 caller: list[str] | None = None) -> bool:
    """Whether `name` is a buffer of zeros with a part written in (a dynamic-update-slice into a broadcast), seen
    through copies, bitcasts and fusions (a fused computation's parameter k being its caller's operand k)."""
    inst = by_name.get(name)
    if inst is None or depth > 8:
        return False
    if inst.op == "dynamic-update-slice":
        return _is_broadcast(operand_names(inst)[0], by_name, caller)
    if inst.op in ("copy", "bitcast"):
        return _zero_padded(operand_names(inst)[0], computations, by_name, roots, depth + 1, caller)
    if inst.op == "fusion":
        called = [c for role, c in called_computations(inst) if role == "calls"]
        root = roots.get(called[0]) if called else None
        return root is not None and _zero_padded(root.name, computations, by_name, roots, depth + 1, operand_names(inst))
    return False


def _is_broadcast(name: str, by_name: dict[str, Instruction], caller: list[str] | None) -> bool:
    base = by_name.get(name)
    while base is not None and base.op in ("copy", "bitcast", "parameter"):
        if base.op == "parameter":
            index = _ints(base.args)
            if caller is None or not index or index[0] >= len(caller):
                return False
            base, caller = by_name.get(caller[index[0]]), None
        else:
            base = by_name.get(operand_names(base)[0])
    return base is not None and base.op == "broadcast"


def _sliced(inst: Instruction, users: dict[str, list[Instruction]]) -> bool:
    """An all-reduce each device then slices its own part out of (every user a dynamic-slice, through the
    get-tuple-elements of a combined one): the program as partitioned, before XLA:GPU's reduce-scatter creator (and
    XLA:TPU's all-reduce-scatter fusion) turns it into the reduce-scatter it runs as."""
    if inst.op != "all-reduce":
        return False
    ends = []
    for user in users.get(inst.name, ()):
        ends += users.get(user.name, []) if user.op == "get-tuple-element" else [user]
    return bool(ends) and all(u.op == "dynamic-slice" for u in ends)


def _collective(inst: Instruction, kind: str, start: bool, computation: str, count: int, exact: str, scattered: bool,
                shape: tuple[int, ...], axis_names: tuple[str, ...], granule: np.ndarray,
                gathering: bool = False) -> Collective:
    raw = bytes_by_dtype(_result(kind, start, inst.shape))
    partitions = granule.size
    if kind == "collective-permute":
        pairs = np.asarray(_ints(_PAIRS.search(inst.attrs).group(1)) if _PAIRS.search(inst.attrs) else [],
                           dtype=int).reshape(-1, 2)
        moving = pairs[pairs[:, 0] != pairs[:, 1]]
        _check_ids(moving, partitions, inst)
        coords = np.stack(np.unravel_index(moving.reshape(-1), shape)).reshape(len(shape), -1, 2)
        axes = tuple(a for a, c in zip(axis_names, coords) if (c[:, 0] != c[:, 1]).any())
        across = bool((granule[moving[:, 0]] != granule[moving[:, 1]]).any())
        return Collective(kind, inst.name, computation, raw, 2, axes, across, count, exact)
    groups = _groups(inst.attrs, partitions)
    n = max(len(g) for g in groups)
    for g in groups:
        _check_ids(g, partitions, inst)
    axes_varying = np.zeros(len(shape), dtype=bool)
    across = False
    for g in groups:
        coords = np.stack(np.unravel_index(g, shape))
        axes_varying |= (coords != coords[:, :1]).any(axis=1)
        across = across or bool((granule[g] != granule[g[0]]).any())
    axes = tuple(a for a, v in zip(axis_names, axes_varying) if v)
    if kind == "reduce-scatter":
        raw = {d: b * n for d, b in raw.items()}
    elif scattered:  # the all-reduce's buffer is the reduce-scatter's input
        kind = "reduce-scatter"
    elif gathering:  # an all-gather run as an all-reduce of zero-padded parts: the all-reduce's bytes
        return Collective("all-gather", inst.name, computation, raw, n, axes, across, count, exact, as_all_reduce=True)
    return Collective(kind, inst.name, computation, raw, n, axes, across, count, exact)


def _check_ids(ids: np.ndarray, partitions: int, inst: Instruction) -> None:
    if ids.size and int(ids.max()) >= partitions:
        raise ValueError(f"{inst.name} names device {int(ids.max())} but the mesh has {partitions} devices: pass the "
                         f"mesh the program was compiled for.")

