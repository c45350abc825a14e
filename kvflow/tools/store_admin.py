"""``kvflow store``: what a KV store holds, and clearing it (docs/operations.md).

``kvflow store stats URL``   capacity, bytes used, objects; per model and layout
``kvflow store ls URL``      one line per object (``--model M`` for one model's)
``kvflow store clear URL``   remove objects (``--model M``: one model's KV and profile announcements)

For ``local://``, ``arena://`` and ``mooncake://`` stores; ``--json`` prints one JSON document for scripts.
Keys are read with :func:`kvflow.keys.decode_key`; the profile book's announcements
(:func:`kvflow.profiles.is_book_key`) are shown apart. A Mooncake cluster lists its keys through its
master's HTTP port (``metrics_port`` in the URL, default 9003); this tool's Mooncake client lends no
memory to the cluster, whatever ``segment`` the URL gives. A local or arena store must exist
already (nothing is created; an arena is read as it was made, whatever capacity and slot the URL
gives).

Everything here runs on one event loop started by :func:`store_main` (``anyio.run``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, unquote

import anyio
import attrs

from kvflow.config import split_url
from kvflow.errors import BackendError, ClearStoppedError, ConfigError, KVFlowError, RequestError
from kvflow.keys import BlockKey, decode_key

__all__ = ["ClearStoppedError", "Inventory", "StoredObject", "clear_store", "read_inventory", "store_main"]

# Keys removed per call: a local store removes a call's keys in one lock section, which every
# engine's puts wait for (as many as its clear removes per section).
_REMOVE_GROUP = 256


@attrs.frozen
class StoredObject:
    """One object: its key (None: a local object named by a digest), its bytes (-1: unknown), and
    what the key says: ``kind`` "kv" (``block`` decoded), "profiles" (an announcement of the
    profile book; ``model`` only) or "other" (not a kvflow key)."""

    key: str | None
    nbytes: int
    kind: str
    model: str | None = None
    block: BlockKey | None = None

    @classmethod
    def of(cls, key: str | None, nbytes: int) -> StoredObject:
        from kvflow.profiles import is_book_key  # imports torch: not at `kvflow --help`

        if key is None:
            return cls(None, nbytes, "other")
        if is_book_key(key):
            return cls(key, nbytes, "profiles", unquote(key.split("@")[1]))
        try:
            block = decode_key(key)
        except RequestError:
            return cls(key, nbytes, "other")
        return cls(key, nbytes, "kv", block.scope.model, block)

    @property
    def layout(self) -> str | None:
        """What the bytes mean, how they lie and the tokens per object: ``meaning order b<tokens>``."""
        if self.block is None:
            return None
        scope = self.block.scope
        return f"{scope.meaning} {scope.order} b{scope.block_size}"

    @property
    def part(self) -> str | None:
        """Which part of a block: model layers, KV heads, context shards."""
        if self.block is None:
            return None
        s = self.block.scope
        layers, heads = f"l{s.layers[0]}-{s.layers[1]}", f"h{s.heads[0]}-{s.heads[1]}"
        return f"{layers} {heads} d{s.dcp[0]}.{s.dcp[1]} p{s.pcp[0]}.{s.pcp[1]}"

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "bytes": self.nbytes,
            "kind": self.kind,
            "model": self.model,
            "layout": self.layout,
            "part": self.part,
            "hash": self.block.block_hash.hex() if self.block is not None else None,
        }


@attrs.frozen
class Inventory:
    """What a store holds: its objects, and its capacity and usage where the store says."""

    url: str
    backend: str
    capacity_bytes: int | None
    used_bytes: int | None
    objects: tuple[StoredObject, ...]

    def of_model(self, model: str | None) -> tuple[StoredObject, ...]:
        """Every object, or those of ``model``: that exact model field, or that name with any
        variant a vLLM engine adds (``name#digest``, kvflow.integrations.vllm.topology)."""
        if model is None:
            return self.objects
        return tuple(o for o in self.objects if o.model is not None and _names(o.model, model))

    def groups(self) -> list[dict[str, Any]]:
        """Per model and layout: objects, distinct blocks, bytes, and the parts blocks are split in."""
        table: dict[tuple[str, str], dict[str, Any]] = {}
        for obj in self.objects:
            if obj.block is None or obj.model is None or obj.layout is None:
                continue
            row = table.setdefault(
                (obj.model, obj.layout),
                {
                    "model": obj.model,
                    "layout": obj.layout,
                    "objects": 0,
                    "bytes": 0,
                    "hashes": set(),
                    "parts": set(),
                },
            )
            row["objects"] += 1
            row["bytes"] += max(0, obj.nbytes)
            row["hashes"].add(obj.block.block_hash)
            row["parts"].add(obj.part)
        rows = []
        for key in sorted(table):
            row = table[key]
            hashes, parts = row.pop("hashes"), row.pop("parts")
            rows.append({**row, "blocks": len(hashes), "parts": sorted(parts)})
        return rows

    def stats(self) -> dict[str, Any]:
        def total(kind: str) -> dict[str, int]:
            chosen = [o for o in self.objects if o.kind == kind]
            return {"objects": len(chosen), "bytes": sum(max(0, o.nbytes) for o in chosen)}

        return {
            "url": self.url,
            "backend": self.backend,
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "objects": len(self.objects),
            "bytes": sum(max(0, o.nbytes) for o in self.objects),
            "models": self.groups(),
            "profiles": [o.to_json() for o in self.objects if o.kind == "profiles"],
            "kv": total("kv"),
            "other": total("other"),
        }


def _scheme(url: str) -> str:
    scheme = split_url(url).scheme
    if scheme not in ("local", "arena", "mooncake"):
        raise ConfigError(f"kvflow store works on local://, arena:// and mooncake:// stores, not {url!r}")
    return scheme


def _open_local(url: str) -> Any:
    """A local or arena store (both list, count and clear themselves), which must exist."""
    if _scheme(url) == "arena":
        from kvflow.backends.arena import ArenaBackend

        return ArenaBackend.attach(url)
    from kvflow.backends.local import LocalBackend, LocalConfig
    from kvflow.backends.local.safety import LOCK_NAME

    config = LocalConfig.from_url(url)
    for part in (LOCK_NAME, "objects"):
        try:
            os.lstat(os.path.join(config.path, part))
        except (FileNotFoundError, NotADirectoryError):  # (opening one makes it: this tool only looks)
            raise ConfigError(
                f"there is no store at {config.path} (nothing to show or clear); check the URL"
            ) from None
        except PermissionError:
            st = os.stat(config.path) if os.access(config.path, os.F_OK) else None
            owner = f" (owned by uid {st.st_uid}, mode {st.st_mode & 0o777:o})" if st is not None else ""
            raise ConfigError(
                f"the store at {config.path}{owner} may not be read by this user: run the command as "
                "the engines' user, or open the store with ?group= so that its group may"
            ) from None
        except OSError as exc:
            raise ConfigError(f"cannot look at a store at {config.path}: {exc}; check the URL") from None
    return LocalBackend(config)


def _open_mooncake(url: str) -> Any:
    from kvflow.backends.mooncake import MooncakeBackend, MooncakeConfig

    return MooncakeBackend(attrs.evolve(MooncakeConfig.from_url(url), segment_bytes=0))


async def read_inventory(url: str, *, sizes: bool = True) -> Inventory:
    """Every object of the store at ``url``, decoded, with its capacity and usage (a local
    store's: its usage counter, read without recounting the files, which would hold the store's
    lock for the whole directory).

    ``sizes=False`` leaves a Mooncake object's size unknown (-1): asking for it leases the object
    to this client for a few seconds (the master's ``--default_kv_lease_ttl``), during which no one
    can remove it.
    """
    scheme = _scheme(url)
    if scheme != "mooncake":
        backend = _open_local(url)
        try:
            listed = await backend.list_objects()
            used = await backend.usage(recount=False) if scheme == "local" else await backend.usage()
            capacity = backend.config.capacity_bytes if _has_capacity(url, scheme) else None
        finally:
            await backend.aclose()
        objects = tuple(StoredObject.of(key, nbytes) for key, nbytes in listed)
        return Inventory(url, scheme, capacity, used, _sorted(objects))
    backend = _open_mooncake(url)
    try:
        keys = await backend.list_keys()
        usage = await backend.cluster_usage()
        nbytes = await backend.object_sizes(keys) if keys and sizes else [-1] * len(keys)
    finally:
        await backend.aclose()
    objects = tuple(StoredObject.of(key, size) for key, size in zip(keys, nbytes))
    return Inventory(url, "mooncake", usage.capacity_bytes, usage.used_bytes, _sorted(objects))


def _has_capacity(url: str, scheme: str) -> bool:
    """Whether the store itself has the capacity its config shows: an arena's is fixed when it is
    made; a local store's is each opening process's own budget, so only the URL can give one."""
    return scheme == "arena" or "capacity" in parse_qs(split_url(url).query)


def _sorted(objects: Sequence[StoredObject]) -> tuple[StoredObject, ...]:
    return tuple(
        sorted(objects, key=lambda o: (o.kind, o.model or "", o.layout or "", o.part or "", o.key or ""))
    )


async def clear_store(url: str, model: str | None = None) -> dict[str, int]:
    """Remove the store's kvflow objects (``model``: that model's KV and profile announcements).

    A local or arena store without ``model`` loses every object, unnamed ones included. A Mooncake cluster
    keeps keys that are not kvflow's. Returns ``{"removed": n, "failed": n, "unnamed": n}``
    (``unnamed``: with ``model``, the objects whose keys the store did not keep, an arena's keys
    over 254 bytes, which may be that model's and were left; Mooncake refuses
    to remove an object a reader holds a lease on, for a few seconds after each read, including
    ``kvflow store ls`` and ``stats``: run it again). Removes 256 objects per call to the store;
    raises :class:`ClearStoppedError`, which says how many went, when the store stops answering
    (a local store's lock held by a stopped engine, say) part-way.
    """
    if _scheme(url) != "mooncake" and model is None:
        backend = _open_local(url)
        try:
            return {"removed": await backend.clear(), "failed": 0, "unnamed": 0}
        except ClearStoppedError as exc:
            raise _stopped(url, None, exc.removed, exc.listed, exc) from exc
        finally:
            await backend.aclose()
    inventory = await read_inventory(url, sizes=False)
    keys = [o.key for o in inventory.of_model(model) if o.key is not None and o.kind != "other"]
    backend = _open_mooncake(url) if inventory.backend == "mooncake" else _open_local(url)
    removed = 0
    try:
        for start in range(0, len(keys), _REMOVE_GROUP):
            try:
                done = await backend.remove(keys[start : start + _REMOVE_GROUP])
            except BackendError as exc:
                raise _stopped(url, model, removed, len(keys), exc) from exc
            removed += sum(1 for ok in done if ok)
    finally:
        await backend.aclose()
    unnamed = sum(1 for o in inventory.objects if o.key is None)
    return {"removed": removed, "failed": len(keys) - removed, "unnamed": unnamed}


def _stopped(url: str, model: str | None, removed: int, listed: int, exc: Exception) -> ClearStoppedError:
    objects = f"objects of model {model!r}" if model else "objects"
    return ClearStoppedError(
        f"removed {removed} of {listed} {objects} from {url}, then: {exc}", removed, listed
    )


def _size(n: int | None) -> str:
    if n is None or n < 0:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"


def _print_stats(stats: dict[str, Any]) -> None:
    used, capacity = stats["used_bytes"], stats["capacity_bytes"]
    share = f" ({100 * used / capacity:.1f}%)" if used is not None and capacity else ""
    print(f"store    {stats['url']} ({stats['backend']})")
    print(f"capacity {_size(capacity)}, used {_size(used)}{share}, {stats['objects']} objects")
    if capacity is None and stats["backend"] == "local":
        print("         (each process that opens a local store sets its own capacity; give the URL one")
        print("          as the engines do, ?capacity=N, to see the share used)")
    rows = stats["models"]
    if rows:
        wm = max(5, *(len(r["model"]) for r in rows))
        wl = max(6, *(len(r["layout"]) for r in rows))
        print(f"\n{'model':<{wm}}  {'layout':<{wl}}  {'blocks':>8} {'objects':>8} {'bytes':>12}  parts")
        for r in rows:
            counts = f"{r['blocks']:>8} {r['objects']:>8} {_size(r['bytes']):>12}"
            _say(f"{r['model']:<{wm}}  {r['layout']:<{wl}}  {counts}  {', '.join(r['parts'])}")
    profiles = stats["profiles"]
    if profiles:
        models = sorted({p["model"] for p in profiles})
        _say(f"\nprofile announcements: {len(profiles)} (models: {', '.join(models)})")
    other = stats["other"]
    if other["objects"]:
        size = _size(other["bytes"])
        print(f"other objects: {other['objects']} ({size}): not kvflow keys, or names without one")


def _print_objects(objects: Sequence[StoredObject]) -> None:
    for o in objects:
        if o.kind == "kv" and o.block is not None:
            _say(f"{_size(o.nbytes):>12}  {o.model}  {o.layout}  {o.part}  {o.block.block_hash.hex()}")
        else:
            _say(f"{_size(o.nbytes):>12}  [{o.kind}]  {o.key if o.key is not None else '(digest name)'}")


def _say(line: str) -> None:
    """Print a line of keys or models as they are, but a lone surrogate (a key may hold one) as an
    escape: it cannot be written to a UTF-8 terminal."""
    print(line.encode("utf-8", "backslashreplace").decode())


def add_store_parser(sub: Any) -> None:
    """The ``store`` command and its subcommands (on the ``kvflow`` parser's subparsers)."""
    store = sub.add_parser(
        "store", help="see what a KV store holds, and clear it (local://, arena://, mooncake://)"
    )
    actions = store.add_subparsers(dest="action", required=True)
    stats = actions.add_parser("stats", help="capacity, bytes used, objects; per model and layout")
    ls = actions.add_parser("ls", help="list the objects (KV blocks and profile announcements)")
    clear = actions.add_parser("clear", help="remove objects: all kvflow objects, or one model's")
    for parser in (stats, ls, clear):
        parser.add_argument(
            "url", help="store URL: local:///path, arena:///path or mooncake://HOST:PORT[?metrics_port=N]"
        )
        parser.add_argument("--json", action="store_true", help="print one JSON document")
    for parser in (ls, clear):
        parser.add_argument(
            "--model", help="only this model's objects (its KV and its profile announcements)"
        )
    clear.add_argument("--yes", action="store_true", help="do it (required when stdout is a terminal)")


def store_main(args: argparse.Namespace) -> int:
    """Run ``kvflow store ACTION``; 0 on success, 1 on a store error, 2 on refusal."""
    try:
        if args.action == "clear":
            return _clear_main(args)
        inventory = anyio.run(read_inventory, args.url)
    except KVFlowError as exc:
        print(f"kvflow store: {exc}", file=sys.stderr)
        return 1
    if args.action == "stats":
        stats = inventory.stats()
        if args.json:
            print(json.dumps(stats, indent=2))
        else:
            _print_stats(stats)
        return 0
    objects = inventory.of_model(args.model)
    if args.json:
        print(json.dumps([o.to_json() for o in objects], indent=2))
    else:
        _print_objects(objects)
    return 0


def _clear_main(args: argparse.Namespace) -> int:
    if args.model is not None and not args.model:
        raise ConfigError("--model needs a model name (to remove every kvflow object, leave --model out)")
    what = f"the objects of model {args.model!r}" if args.model else "every kvflow object"
    if sys.stdout.isatty() and not args.yes:
        print(
            f"kvflow store clear: this removes {what} from {args.url}, for every engine that uses it; "
            "run it again with --yes to do it",
            file=sys.stderr,
        )
        return 2
    try:
        outcome = anyio.run(clear_store, args.url, args.model)
    except ClearStoppedError as exc:
        if args.json:
            stopped = {"removed": exc.removed, "failed": exc.listed - exc.removed, "error": str(exc)}
            print(json.dumps({"url": args.url, "model": args.model, **stopped}))
        print(f"kvflow store: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"url": args.url, "model": args.model, **outcome}))
    else:
        print(f"removed {outcome['removed']} objects ({what}) from {args.url}")
        if outcome["failed"]:
            why = "held by a reader?" if _scheme(args.url) == "mooncake" else "the log says why"
            print(f"{outcome['failed']} could not be removed now ({why}): run it again")
    if outcome["unnamed"]:
        print(
            f"kvflow store: {outcome['unnamed']} objects were left whose keys the store did not keep "
            "(an arena keeps keys of up to 254 bytes; a long model name makes longer ones): they may "
            f"be this model's; `kvflow store clear {args.url} --yes` without --model removes every object",
            file=sys.stderr,
        )
    return 0 if not outcome["failed"] and not outcome["unnamed"] else 1


def _names(field: str, model: str) -> bool:
    """Whether a key's model ``field`` is ``model``'s, exactly or with a variant digest."""
    if field == model:
        return True
    name, mark, variant = field.rpartition("#")
    return (
        bool(mark) and name == model and len(variant) == 16 and all(c in "0123456789abcdef" for c in variant)
    )
