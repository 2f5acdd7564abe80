"""What a small torch file can hide from ``torch.load(weights_only=True)``: a pickle that calls an
allowed global with arguments that run for hours or allocate without end, a compressed zip record,
a tensor that expands to gigabytes once used (a stride of 0). Checked before a file written by
someone else is used: checkpoints, warm-up cache entries, trajectory points."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import io
import os
import pickletools
import zipfile
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import IO, Any

import torch


def contents(value: Any) -> Iterator[Any]:
    """What a loaded container holds: a dict's keys and values, a list's, tuple's or set's items, a
    dataclass instance's fields (the allow-listed objects a checkpoint may hold, such as the
    anchor circuit's ``Rollouts``); nothing for anything else."""
    if isinstance(value, dict):  # dict's own methods: an instance's attributes cannot hide its items
        yield from dict.keys(value)
        yield from dict.values(value)
    elif isinstance(value, (list, tuple, set, frozenset)):
        yield from value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        yield from vars(value).values()


def thin_tensor(obj: Any) -> str | None:
    """Why a tensor in ``obj`` is not one torch.save writes for state of its own, or None: a
    strided tensor whose storage holds fewer bytes than its shape covers (a stride of 0 makes one
    stored number a weight of any size, and copying it into a model or an optimizer allocates all
    of it), or a tensor of another layout. Walks all of ``obj``: bound it first."""
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                return f"it holds a tensor of layout {value.layout}, not a dense one"
            covered = value.numel() * value.element_size()
            stored = value.untyped_storage().nbytes()
            if covered > stored:
                return (f"it holds a tensor of shape {tuple(value.shape)} over {stored} stored bytes, where its "
                        f"shape covers {covered}")
        else:
            stack.extend(contents(value))
    return None


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The floating dtypes tclightning's state is kept in (and torch checks for NaN on any device): a
float8 or float4 tensor in a checkpoint, a point or a replay is none of its own."""


class BrokenTensorFile(Exception):
    """A file ``torch.save`` did not write whole: no zip archive (cut short, garbage, the legacy
    format) or a record that cannot be read."""


class RefusedTensorFile(Exception):
    """A torch file holding what ``torch.save`` never writes for the state it is read for: possibly
    crafted, so it is never loaded."""


MAX_KEPT_BYTES = 2**30
"""The most bytes a :class:`FirstReads` view keeps: what the check reads of a torch file is its
archive's directory, headers and pickle (a few MB for a 1.5B-parameter model's checkpoint), never
its tensors' bytes."""


class FirstReads(io.RawIOBase):
    """A read-only view of an open file that keeps every byte read from it while it records, and
    gives the kept byte on every later read of that byte. Check a torch file through it
    (:func:`check_torch_file` stops the recording once the file passed), then ``torch.load`` it:
    the directory, headers and pickle ``torch.load`` reads are those checked, whatever is written
    into the file meanwhile (a pickle rewritten in place after its check would run), and only the
    tensors' bytes, which the check never reads, come from the file then (data, never code), so
    a checkpoint of any size costs no copy. The file's size is taken once, when the view is made."""

    def __init__(self, handle: IO[bytes]) -> None:
        super().__init__()
        self._handle = handle  # kept open as long as the view is
        self._fd = handle.fileno()
        self._size = os.fstat(self._fd).st_size
        self._position = 0
        self._starts: list[int] = []  # the kept runs, sorted and apart: _starts[i] is where _runs[i] starts
        self._runs: list[bytearray] = []
        self._kept = 0
        self.recording = True

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._position = base + offset
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        start, end = self._position, min(self._position + len(view), self._size)
        at, index = start, max(bisect.bisect_right(self._starts, start) - 1, 0)
        while at < end:
            while index < len(self._starts) and self._starts[index] + len(self._runs[index]) <= at:
                index += 1  # runs that end before: past them
            if index < len(self._starts) and self._starts[index] <= at:  # kept: the byte as it was first read
                run_start, run = self._starts[index], self._runs[index]
                taken = min(end, run_start + len(run)) - at
                view[at - start:at - start + taken] = run[at - run_start:at - run_start + taken]
            else:  # up to the next kept run, from the file
                upto = min(end, self._starts[index]) if index < len(self._starts) else end
                taken = os.preadv(self._fd, [view[at - start:upto - start]], at)
                if taken == 0:  # the file was cut short since: it ends here
                    break
                if self.recording:
                    self._keep(at, view[at - start:at - start + taken], index)
                    index = max(bisect.bisect_right(self._starts, at) - 1, 0)  # runs may have merged
            at += taken
        self._position = at
        return at - start

    def _keep(self, at: int, data: memoryview, index: int) -> None:
        """Keep ``data``, read from the file at ``at``, just before the run ``index`` (or last)."""
        self._kept += len(data)
        if self._kept > MAX_KEPT_BYTES:
            raise RefusedTensorFile(f"its archive's directory, headers and pickle hold more than {MAX_KEPT_BYTES} "
                                    "bytes, which torch.save never writes")
        if index > 0 and self._starts[index - 1] + len(self._runs[index - 1]) == at:  # reads go on where one ended
            self._runs[index - 1] += data
        else:
            self._starts.insert(index, at)
            self._runs.insert(index, bytearray(data))
            index += 1
        if index < len(self._starts) and self._starts[index - 1] + len(self._runs[index - 1]) == self._starts[index]:
            self._runs[index - 1] += self._runs.pop(index)
            self._starts.pop(index)


def first_reads(handle: IO[bytes]) -> IO[bytes]:
    """``handle``, an open file at its start, as a :class:`FirstReads` view to check and load it
    through; a file with no descriptor (a ``BytesIO``: in memory already) or not at its start
    (refused by :func:`check_torch_file`) as it is."""
    try:
        if handle.tell() != 0:
            return handle
        handle.fileno()
    except (AttributeError, OSError, ValueError):
        return handle
    return FirstReads(handle)


def load_checked(handle: IO[bytes], map_location: Any = "cpu", *, classes: Collection[type] = (),
                 numpy_arrays: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of the open file ``handle`` once :func:`check_torch_file`
    passed it (``classes``, ``numpy_arrays`` as there), both reading through one
    :func:`first_reads` view: what ``torch.load`` unpickles is what was checked, whatever is
    written into the file meanwhile. The check's :class:`RefusedTensorFile` or
    :class:`BrokenTensorFile`, or what ``torch.load`` raises."""
    handle = first_reads(handle)
    check_torch_file(handle, classes=classes, numpy_arrays=numpy_arrays)
    return torch.load(handle, map_location=map_location, weights_only=True)


def seekable(handle: Any) -> bool:
    try:
        return bool(handle.seekable())
    except (AttributeError, OSError, ValueError):  # no seekable(), or a closed file
        return False


def check_torch_file(source: str | os.PathLike | IO[bytes], *, classes: Collection[type] = (),
                     numpy_arrays: bool = False) -> None:
    """Read ``source`` (a path, or an open file, read from and left where it was) as
    ``torch.load(weights_only=True)`` would, without building anything, and raise
    :class:`RefusedTensorFile` for what no ``torch.save`` of plain state writes, before any of it
    runs: a compressed record (a small file that expands to gigabytes), a storage larger than its
    record, and a pickle that calls anything but the tensor rebuilders with the arguments
    ``torch.save`` gives them. ``weights_only`` lets a pickle call each allowed global with any
    arguments: ``set`` or a dict key over tuples sharing themselves hashes for ages, ``bytearray(10**12)``
    allocates, ``_codecs.encode(text, "punycode")`` is quadratic. ``classes`` may be built empty and
    given a dict of fields (dataclasses such as ``Rollouts``); ``numpy_arrays`` allows the arrays and
    dtypes numpy pickles (a NumPy RNG state). :class:`BrokenTensorFile` for a file that is no
    archive ``torch.save`` writes. :func:`load_checked` checks and loads an open file so that what
    was checked is what ``torch.load`` reads."""
    if not isinstance(source, (str, os.PathLike)) and not seekable(source):
        raise RefusedTensorFile("the open file cannot be read twice (a pipe or a socket): the check and torch.load "
                                "each read it from its start; give a file")
    start = source.tell() if not isinstance(source, (str, os.PathLike)) else None
    if start:  # torch.load reads from where the file is, the checks from its start: never two readings
        raise RefusedTensorFile(f"the open file is at byte {start}, not at its start, where torch.load would read "
                                "something else than the file checked: give it at its start")
    try:
        try:
            archive = zipfile.ZipFile(source)
        except (zipfile.BadZipFile, EOFError, ValueError) as err:
            raise BrokenTensorFile("not a torch file (torch.save writes a zip archive)") from err
        with archive:
            infos = archive.infolist()
            # torch finds records by name ignoring case, the first of equal names; Python's zipfile
            # the last, by exact name, and cuts a name at a NUL: names must not leave them a choice
            records = {info.filename.lower(): info for info in infos}
            if len(records) < len(infos) or any(info.orig_filename != info.filename for info in infos):
                raise RefusedTensorFile("its archive holds two records of one name (ignoring case) or a name with a "
                                        "NUL, which torch.save never writes")
            pickles = [name for name in records if name.endswith(".pkl")]
            if not pickles:
                raise BrokenTensorFile("not a torch file (its archive holds no data.pkl)")
            if len(pickles) > 1:  # torch.save writes one
                raise RefusedTensorFile(f"its archive holds {len(pickles)} pickles, where torch.save writes one")
            compressed = next((info.filename for info in infos if info.compress_type != zipfile.ZIP_STORED), None)
            if compressed is not None:
                raise RefusedTensorFile(f"its record {compressed} is compressed, which torch.save never does (a "
                                        "small file that would expand to gigabytes?)")
            size = _size_of(source)
            if sum(info.compress_size for info in infos) > size:  # records sharing their bytes
                raise RefusedTensorFile("its records hold more bytes than the file (records that overlap: a small file "
                                        "read as gigabytes), which torch.save never writes")
            _require_one_reading(source, archive, infos, size)
            (name,) = pickles
            folder = name.rpartition("/")[0]
            sizes = {key.removeprefix(f"{folder}/data/"): info.file_size for key, info in records.items()
                     if key.startswith(f"{folder}/data/")}
            with archive.open(records[name]) as pickled:
                _PickleCheck(sizes, {f"{c.__module__} {c.__qualname__}": frozenset(f.name for f in dataclasses.fields(c))
                                     for c in classes}, numpy_arrays).run(pickled)
            for small in (records.get(f"{folder}/{record}") for record in TORCH_READS_BY_NAME):
                if small is not None and small.file_size > MAX_SMALL_RECORD_BYTES:
                    raise RefusedTensorFile(f"its record {small.filename[:80]!r} holds {small.file_size} bytes, where "
                                            f"torch.save writes a few")
                if small is not None:  # read as checked too (its byte order decides how the tensors' bytes read)
                    data = archive.read(small)
                    if small.filename.endswith("/byteorder") and data not in (b"little", b"little\n"):
                        raise RefusedTensorFile(f"its byteorder record says {data[:16]!r}, where a machine that runs "
                                                "tclightning writes 'little' (torch swaps the bytes of every tensor "
                                                "of another order, and crashes doing so on the meta device)")
        if isinstance(source, FirstReads):  # torch.load reads what was checked, and only tensors' bytes afresh
            source.recording = False
    except OSError as err:
        raise BrokenTensorFile(f"cannot read it: {err.strerror or err}") from err
    except (zipfile.BadZipFile, EOFError, RuntimeError, NotImplementedError) as err:  # a record cut or encrypted
        raise BrokenTensorFile(f"its archive is damaged ({' '.join(str(err).split())[:80]})") from err
    finally:
        if start is not None:
            source.seek(start)


TORCH_READS_BY_NAME = ("byteorder", ".format_version", ".storage_alignment", "version", ".data/version",
                       ".data/serialization_id")
"""The few-byte records of a torch file ``torch.load`` reads besides its pickle and its tensors."""

MAX_SMALL_RECORD_BYTES = 4096


LARGEST_HASHED_INT = 2**61 - 2
"""Ints up to this size hash to themselves (CPython reduces them modulo 2^61 - 1): keys beyond it
can be made to collide, and a dict of colliding keys takes quadratic time to fill."""

def _require_one_reading(source: str | os.PathLike | IO[bytes], archive: zipfile.ZipFile, infos: list[zipfile.ZipInfo],
                         size: int) -> None:
    """Refuse an archive that torch's reader (miniz) could read otherwise than Python's zipfile,
    which the checks read: the two find the end record, the zip64 end record and the directory in
    different ways (a search from the end, the locator's offset, the stated offset; or the record
    right before, the directory right before), so only the layout ``torch.save`` writes is read
    alike. The archive starts the file (torch takes a file whose first bytes are not a record's for
    a pickle of its pre-1.6 format, read from byte 0), the end record ends it (no comment), a
    zip64 locator names the zip64 end record right before it, and the directory ends where they
    start (zipfile's "concat" is 0). Then torch's own reader must list the same records at the
    same bytes."""
    import struct

    def refuse(why: str) -> RefusedTensorFile:
        return RefusedTensorFile(f"{why}, which torch.save never writes (a reader could find another archive than "
                                 "the one checked)")

    with (open(source, "rb") if isinstance(source, (str, os.PathLike)) else contextlib.nullcontext(source)) as handle:
        handle.seek(0)  # torch reads a file as an archive only if one starts it (else as a pickle, from byte 0)
        if min((info.header_offset for info in infos), default=0):
            raise refuse("it holds data before its archive")
        if handle.read(4) != b"PK\x03\x04":  # where its first record should start
            raise BrokenTensorFile("its archive is damaged (its first record's header is not where its directory "
                                   "says)")
        handle.seek(max(0, size - 98))  # a zip64 end record (56 bytes), its locator (20), the end record (22)
        tail = handle.read()
        if tail[-22:-18] != b"PK\x05\x06" or tail[-2:] != b"\0\0":
            raise refuse("its archive does not end with its end record (a comment or bytes after it)")
        directory_size, directory_at = struct.unpack("<II", tail[-10:-2])
        directory_ends = size - 22
        if tail[-42:-38] == b"PK\x06\x07":
            (named,) = struct.unpack("<Q", tail[-34:-26])
            directory_ends = size - 98
            if len(tail) < 98 or named != directory_ends or tail[:4] != b"PK\x06\x06":
                raise refuse("its zip64 locator names another end record than the one before it")
            directory_size, directory_at = struct.unpack("<QQ", tail[40:56])
        if directory_at + directory_size != directory_ends or directory_at != archive.start_dir:
            raise refuse("its directory is not where its end record says")
        folder = infos[0].filename.partition("/")[0] if infos else ""
        offsets = {}
        for info in infos:  # where each record's bytes start: after its local header, name and extra field
            handle.seek(info.header_offset)  # all of it read (a FirstReads view keeps what torch.load reads of it)
            header = handle.read(30)
            if len(header) < 30 or header[:4] != b"PK\x03\x04":
                raise BrokenTensorFile(f"its archive is damaged (record {info.filename[:80]!r} has no header where its "
                                       "directory says)")
            name_length, extra_length = struct.unpack("<HH", header[26:])
            handle.read(name_length + extra_length)
            offsets[info.filename] = (info.header_offset + 30 + name_length + extra_length, info.file_size)
        handle.seek(0)
        reader = torch._C.PyTorchFileReader(handle)
        names = reader.get_all_records()
        if len(names) != len(infos) or any(offsets.get(f"{folder}/{name}") != (reader.get_record_offset(name),
                                                                             reader.get_record_size(name))
                                           for name in names):
            raise refuse("torch's reader finds other records in it than the ones checked")


def _size_of(source: str | os.PathLike | IO[bytes]) -> int:
    """The size of the file ``source`` names or is (an open file's position is the caller's to restore)."""
    if isinstance(source, (str, os.PathLike)):
        return os.stat(source).st_size
    return source.seek(0, os.SEEK_END)


MAX_OPEN_MARKS = 1_000
"""The most pickle marks open at once (torch.save nests them as deep as the state nests: a few):
each holds a list, so a file of nothing but marks would cost ~80 bytes of memory a byte."""

MAX_INT_KEYS = 16_384
"""The most int keys one dict may have (an optimizer's state has one per parameter tensor: a few
hundred). Ints hash to themselves, so a pickle can choose keys whose slots all probe into each
other; this bounds that to well under a second."""


@dataclasses.dataclass(frozen=True, eq=False)
class _Value:
    """What the pickle machine would hold, without building it: ``kind`` is str, bytes, int,
    float, bool, none, tuple, list, dict, set, global (``text`` its dotted name), storage, tensor,
    array, dtype (numpy's), torch dtype or object (``text`` its class); a short str's ``text``, an
    int's ``number``, a tuple's ``items``. Compared by identity: a dict's keys are counted per dict."""
    kind: str
    text: str | None = None
    number: int | None = None
    items: tuple[_Value, ...] = ()


_NONE, _TRUE, _FALSE, _EMPTY = _Value("none"), _Value("bool"), _Value("bool"), _Value("tuple")


def _tuple(items: list[_Value]) -> _Value:
    return _Value("tuple", items=tuple(items))


def _plain_key(key: _Value) -> bool:
    """Whether ``key`` is a key torch.save writes for tclightning's state, one whose hash a pickle
    cannot choose to collide: a str or bytes (hashed with the process's random seed), a bool, None,
    or an int that hashes to itself. A tuple's hash can be made to collide from small ints, and
    hashing one that holds itself twice per level takes 2^levels steps."""
    if key.kind == "int":
        return key.number is not None and abs(key.number) <= LARGEST_HASHED_INT
    return key.kind in ("str", "bytes", "bool", "none")


_TENSOR_REBUILD = "torch._utils _rebuild_tensor_v2"
_TENSOR_REBUILD_BY_DTYPE = "torch._utils _rebuild_tensor_v3"  # float8, uint16/32/64: a byte storage and a dtype
_BYTE_STORAGE = "torch.storage UntypedStorage"
_PARAMETER_REBUILD = "torch._utils _rebuild_parameter"  # an nn.Parameter saved as it is (weights a user pickled)
_NUMPY_RECONSTRUCT = ("numpy._core.multiarray _reconstruct", "numpy.core.multiarray _reconstruct")
_NUMPY_GLOBALS = ("numpy ndarray", "numpy dtype", *_NUMPY_RECONSTRUCT)


class _PickleCheck:
    """Runs the opcodes ``torch.load(weights_only=True)`` reads over :class:`_Value` stand-ins,
    refusing each step ``torch.save`` never writes (see :func:`check_torch_file`)."""

    def __init__(self, storage_bytes: dict[str, int], classes: Mapping[str, frozenset[str]], numpy_arrays: bool) -> None:
        self.storage_bytes, self.classes, self.numpy_arrays = storage_bytes, classes, numpy_arrays
        self.stack: list[_Value] = []
        self.marks: list[list[_Value]] = []
        self.memo: dict[int, _Value] = {}
        self.int_keys: dict[_Value, int] = {}  # per dict
        self.not_metadata: set[_Value] = set()  # dicts holding a key other than "_metadata"
        self.keys: dict[_Value, list[str | None]] = {}  # per dict: its str keys' text (None: another key)
        self.unbuilt: set[_Value] = set()  # objects made (NEWOBJ) whose fields no BUILD has set yet

    def run(self, pickled: IO[bytes]) -> None:
        try:
            for opcode, arg, _ in pickletools.genops(pickled):
                if opcode.name == "STOP":
                    if self.unbuilt:  # an object without its fields fails wherever one is read
                        made = (next(iter(self.unbuilt)).text or "an object").replace(" ", ".")
                        raise RefusedTensorFile(f"its pickle builds a {made} without setting its fields, which "
                                                "torch.save never writes")
                    return
                self.step(opcode.name, arg)
        except (ValueError, IndexError, KeyError, EOFError) as err:  # genops: cut short; ours: a stack underflow
            raise BrokenTensorFile(f"its pickle is damaged ({type(err).__name__})") from err
        raise BrokenTensorFile("its pickle is cut short")

    def step(self, name: str, arg: Any) -> None:
        stack, push = self.stack, self.stack.append
        if name in _LEAVES:
            push(_LEAVES[name](arg))
        elif name in ("BINPUT", "LONG_BINPUT"):
            self.memo[arg] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET"):
            push(self.memo[arg])
        elif name == "MARK":
            if len(self.marks) >= MAX_OPEN_MARKS:
                raise RefusedTensorFile(f"its pickle opens more than {MAX_OPEN_MARKS} marks at once, which torch.save "
                                        "never writes")
            self.marks.append(self.stack)
            self.stack = []
        elif name == "TUPLE":
            items = self._pop_mark()
            self.stack.append(_tuple(items))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            count = int(name[-1])
            if len(stack) < count:
                raise IndexError("stack underflow")
            stack[-count:] = [_tuple(stack[-count:])]
        elif name == "APPEND":
            stack.pop()
            self._expect(stack[-1], "list", "APPEND")
        elif name == "APPENDS":
            self._pop_mark()
            self._expect(self.stack[-1], "list", "APPENDS")
        elif name in ("SETITEM", "SETITEMS"):
            items = [stack.pop(), stack.pop()][::-1] if name == "SETITEM" else self._pop_mark()
            target = self.stack[-1]
            self._expect(target, "dict", name)
            slow = next((key for key in items[::2] if not _plain_key(key)), None)
            if slow is not None or len(items) % 2:
                raise RefusedTensorFile(f"its pickle keys a dict by a value that can take ages to hash (a "
                                        f"{slow.kind if slow else 'key with no value'}), which torch.save never writes")
            self.int_keys[target] = self.int_keys.get(target, 0) + sum(key.kind == "int" for key in items[::2])
            self.keys.setdefault(target, []).extend(key.text if key.kind == "str" else None for key in items[::2])
            if any(key.kind != "str" or key.text != "_metadata" or value.kind != "dict"
                   for key, value in zip(items[::2], items[1::2])):
                self.not_metadata.add(target)  # a state dict's _metadata is a dict (of each module's version)
            if self.int_keys[target] > MAX_INT_KEYS:
                raise RefusedTensorFile(f"its pickle fills a dict with more than {MAX_INT_KEYS} int keys (ints a pickle "
                                        "chooses can take ages to hash into one dict), which torch.save never writes")
        elif name == "GLOBAL":
            push(self._global(arg))
        elif name == "BINPERSID":
            push(self._storage(stack.pop()))
        elif name == "REDUCE":
            args = stack.pop()
            stack[-1] = self._call(stack[-1], args)
        elif name == "NEWOBJ":
            args, cls = stack.pop(), stack.pop()
            if cls.kind != "global" or cls.text not in self.classes or args.kind != "tuple" or args.items:
                raise RefusedTensorFile(f"its pickle builds {_named(cls)}, which torch.save never writes here")
            made = _Value("object", cls.text)
            self.unbuilt.add(made)
            push(made)
        elif name == "BUILD":
            self._build(stack.pop(), stack[-1])
        elif name != "PROTO":
            raise RefusedTensorFile(f"its pickle uses the instruction {name}, which torch.load(weights_only=True) "
                                    "does not read (torch.save writes it only with a pickle_protocol above its default 2)")

    def _pop_mark(self) -> list[_Value]:
        items, self.stack = self.stack, self.marks.pop()
        return items

    @staticmethod
    def _expect(target: _Value, kind: str, opcode: str) -> None:
        if target.kind != kind:
            raise RefusedTensorFile(f"its pickle applies {opcode} to a {target.kind}")

    def _global(self, dotted: str) -> _Value:
        module, _, attr = dotted.partition(" ")
        module = "builtins" if module == "__builtin__" else module  # protocol 2's name for it
        if module == "torch" and isinstance(getattr(torch, attr, None), torch.dtype):
            return _Value("torch dtype", attr)
        allowed = (dotted in (_TENSOR_REBUILD, _TENSOR_REBUILD_BY_DTYPE, _PARAMETER_REBUILD, _BYTE_STORAGE,
                              "collections OrderedDict", "_codecs encode")
                   or (module == "torch" and attr.endswith("Storage") and _storage_dtype(attr) is not None)
                   or dotted in self.classes or (self.numpy_arrays and dotted in _NUMPY_GLOBALS))
        if not allowed:
            raise RefusedTensorFile(f"it asks to load {module}.{attr}, which this file never holds (loading it "
                                    "could run code or expand without end)")
        return _Value("global", dotted)

    def _storage(self, pid: _Value) -> _Value:
        kind, storage_type, key, _location, numel = (pid.items if pid.kind == "tuple" and len(pid.items) == 5
                                                     else (None,) * 5)
        dtype = None
        if storage_type is not None and storage_type.kind == "global":
            dtype = torch.uint8 if storage_type.text == _BYTE_STORAGE else \
                _storage_dtype(storage_type.text.partition(" ")[2])
        if kind is None or kind.text != "storage" or dtype is None or key.kind != "str" or numel.kind != "int" \
                or numel.number is None:
            raise RefusedTensorFile("its pickle asks for a storage in a form torch.save never writes")
        stored = self.storage_bytes.get((key.text or "").lower())
        if stored is None or not 0 <= numel.number * dtype.itemsize <= stored:
            raise RefusedTensorFile(f"its pickle asks for a storage of {numel.number} values from a record of "
                                    f"{stored} bytes, which torch.save never writes")
        return _Value("storage")

    def _call(self, func: _Value, args: _Value) -> _Value:
        """What calling ``func`` with ``args`` gives, for the calls ``torch.save`` writes."""
        items = args.items if args.kind == "tuple" else None
        name = func.text if func.kind == "global" else None
        if items is not None:
            if name == _TENSOR_REBUILD and items and items[0].kind == "storage":
                return _Value("tensor")  # any size or stride: loaded tensors are checked (thin_tensor)
            if name == _TENSOR_REBUILD_BY_DTYPE and len(items) in (7, 8) and items[0].kind == "storage" \
                    and items[6].kind == "torch dtype":
                return _Value("tensor")
            if name == _PARAMETER_REBUILD and len(items) == 3 and items[0].kind == "tensor" and items[1].kind == "bool":
                return _Value("tensor")
            if name == "collections OrderedDict" and not items:  # filled by SETITEMS, each key checked
                return _Value("dict")
            if name == "_codecs encode" and [i.kind for i in items] == ["str", "str"] \
                    and items[1].text in ("latin1", "latin-1"):  # how protocol 2 writes bytes
                return _Value("bytes")
            if name in _NUMPY_RECONSTRUCT and len(items) == 3 and items[0].text == "numpy ndarray" \
                    and items[1].kind == "tuple" and [i.number for i in items[1].items] == [0] \
                    and items[2].kind in ("bytes", "dtype"):
                return _Value("array")  # an empty array; BUILD gives its shape and bytes, which numpy matches
            if name == "numpy dtype" and [i.kind for i in items] == ["str", "bool", "bool"] \
                    and items[0].text is not None and len(items[0].text) <= 8:
                return _Value("dtype")
        raise RefusedTensorFile(f"its pickle calls {_named(func)} with arguments torch.save never gives it (a call "
                                "that could run for hours or allocate without end)")

    def _build(self, state: _Value, target: _Value) -> None:
        fields = state.items if state.kind == "tuple" else ()
        given = state if state.kind == "dict" else fields[0] if len(fields) == 2 and fields[1].kind == "none" else None
        if target.kind == "object" and given is not None and given.kind == "dict" \
                and sorted(self.keys.get(given, []), key=str) == sorted(self.classes[target.text or ""]):
            self.unbuilt.discard(target)
            return  # a dataclass's fields, each once: an attribute more could hide a method (``select``)
        if target.kind == "dict" and state.kind == "dict" and state not in self.not_metadata:
            return  # a state dict's ``_metadata``; any other attribute could hide its items (``values``)
        if target.kind == "dtype" and _plain_dtype_state(fields):
            return
        if target.kind == "array" and len(fields) == 5 and fields[1].kind == "tuple" and len(fields[1].items) <= 32 \
                and all(d.kind == "int" for d in fields[1].items) and fields[2].kind == "dtype" \
                and fields[4].kind == "bytes":
            return
        raise RefusedTensorFile(f"its pickle sets the state of a {target.kind} in a form torch.save never writes")


def _plain_dtype_state(fields: tuple[_Value, ...]) -> bool:
    """Whether ``fields`` is the state numpy pickles for a plain numeric dtype: ``(3, byte order,
    None, None, None, -1, -1, 0)``. Its last field holds numpy's flags, and the flags of an object
    dtype would make numpy read an array's numbers as object pointers."""
    kinds = [field.kind for field in fields]
    return (kinds == ["int", "str", "none", "none", "none", "int", "int", "int"] and fields[0].number == 3
            and fields[1].text in ("<", ">", "|", "=") and fields[5].number == fields[6].number == -1
            and fields[7].number == 0)


def _named(value: _Value) -> str:
    return value.text.replace(" ", ".") if value.kind == "global" and value.text else f"a {value.kind}"


def _storage_dtype(name: str) -> torch.dtype | None:
    """The dtype of the storage class ``name`` (``FloatStorage``), or None if torch knows none."""
    try:
        return torch.serialization.StorageType(name).dtype
    except (KeyError, AttributeError, RuntimeError):
        return None


def _short(text: str) -> str | None:
    return text if len(text) <= 64 else None


_LEAVES: dict[str, Callable[[Any], _Value]] = {
    "NONE": lambda _: _NONE, "NEWTRUE": lambda _: _TRUE, "NEWFALSE": lambda _: _FALSE,
    "EMPTY_TUPLE": lambda _: _EMPTY, "EMPTY_LIST": lambda _: _Value("list"), "EMPTY_DICT": lambda _: _Value("dict"),
    "EMPTY_SET": lambda _: _Value("set"), "BINFLOAT": lambda _: _Value("float"),
    **{op: lambda n: _Value("int", number=n) for op in ("BININT", "BININT1", "BININT2", "LONG1")},
    **{op: lambda text: _Value("str", _short(text)) for op in ("BINUNICODE", "SHORT_BINSTRING")},
}
"""Instructions that push a plain value (no call, nothing looked up)."""
