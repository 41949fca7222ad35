"""The models one coordinator serves, by every name a request may use for them.

Each model is a ServedModel (coordinator/model.py: its config, tokenizer and chat template,
names and fingerprint). The first is the default: the one a single-model caller means, and
the one logged first. Invariants, checked when the catalog is made:

    fingerprints are distinct   two entries of one file would share one set of workers
    names are distinct          every name (any spelling of it: "a", "a:latest",
                                "library/a") leads to exactly one model: a name given to
                                two models is refused; a name only derived from two paths
                                (two directories both called "model") names neither

A model's names change at run time (/api/copy adds one, /api/delete drops one); the catalog
then holds the replaced ServedModel under the same fingerprint, so a name is never taken from
one model and given to another here (model_routes.py refuses names in use first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

from common.errors import ModelNotFoundError, TandemError
from common.model_store import ModelStore
from common.model_name import name_key, path_spellings
from coordinator.model import ServedModel, shown


class ModelCatalog:
    def __init__(self, models: Iterable[ServedModel]) -> None:
        self._models: dict[str, ServedModel] = {}  # fingerprint -> model, in serving order
        models = _without_shared_path_names(list(models))
        for model in models:
            if model.fingerprint in self._models:
                raise ValueError(f"{model.name!r} and {self._models[model.fingerprint].name!r} "
                                 "are the same model (one file): serve it once")
            for other in self._models.values():
                clash = _shared_name(model, other)
                if clash is not None:
                    raise ValueError(f"the name {clash!r} would name two models: "
                                     f"{other.name!r} ({other.path}) and {model.name!r} "
                                     f"({model.path}); give one of them --model-name")
            self._models[model.fingerprint] = model
        if not self._models:
            raise ValueError("a coordinator serves at least one model")
        # What a 404 adds for a name that is not served (the coordinator's store says whether
        # it holds the name: then restarting with --model serves it).
        self.missing_hint: Callable[[str], str] = lambda name: ""

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(list(self._models.values()))

    def __len__(self) -> int:
        return len(self._models)

    @property
    def default(self) -> ServedModel:
        return next(iter(self._models.values()))

    @property
    def fingerprints(self) -> tuple[str, ...]:
        return tuple(self._models)

    def by_fingerprint(self, fingerprint: str) -> ServedModel:
        return self._models[fingerprint]

    def find(self, name: str) -> ServedModel | None:
        return next((m for m in self._models.values() if m.answers_to(name)), None)

    def get(self, name: str) -> ServedModel:
        """The model a request names; ModelNotFoundError (HTTP 404, gRPC NOT_FOUND) if none."""
        model = self.find(name)
        if model is None:
            raise ModelNotFoundError(f"model '{shown(name)}' not found{self.missing_hint(name)}")
        return model

    # ---- models added and removed at run time (coordinator/on_demand.py) ------------------------

    def add(self, model: ServedModel) -> None:
        """A model loaded on request joins, after the others; the invariants hold as at start
        (ValueError: its file is served already, or one of its names is another model's)."""
        if model.fingerprint in self._models:
            raise ValueError(f"{model.name!r} is {self._models[model.fingerprint].name!r}, "
                             "which is served already")
        # A name only derived from its path (a blob's file name) that another model answers
        # to is dropped, as at start; a name it was asked by is refused below.
        derived = {n for n in _path_names(model)
                   if any(o.answers_to(n) for o in self._models.values())}
        if derived:
            model = dataclasses.replace(model, names=model.names - derived)
        for other in self._models.values():
            clash = _shared_name(model, other)
            if clash is not None:
                raise ValueError(f"the name {clash!r} would name two models: {other.name!r} "
                                 f"({other.path}) and {model.name!r} ({model.path})")
        self._models[model.fingerprint] = model

    def remove(self, fingerprint: str) -> None:
        """A model unloaded (its workers stopped). The default model is never removed: a
        request that names no model means it."""
        if fingerprint == self.default.fingerprint:
            raise ValueError("the default model is not removed")
        self._models.pop(fingerprint, None)

    # ---- names added and dropped at run time (/api/copy, /api/create, /api/delete) --------------

    def add_name(self, model: ServedModel, name: str) -> None:
        """`model` answers to `name` too (a copy of it was made)."""
        owner = self.find(name)
        if owner is not None and owner.fingerprint != model.fingerprint:
            raise ValueError(f"the name {name!r} is {owner.name!r}'s")
        current = self._models[model.fingerprint]
        self._models[model.fingerprint] = dataclasses.replace(current, names=current.names | {name})

    def drop_name(self, name: str) -> None:
        """`name` was deleted from the store. The names a model was served under (its name,
        its path, the path's file name and stem) stay."""
        for fingerprint, model in self._models.items():
            if name in model.names and name not in (model.name, *path_spellings(str(model.path))):
                self._models[fingerprint] = dataclasses.replace(model, names=model.names - {name})


def not_served_hint(store: ModelStore, name: str) -> str:
    """For a 404: a name the store holds (pulled, created, copied) but this server does not
    serve can be served by a restart: the workers are started with the server, not per request."""
    try:
        store.resolve(name, paths=False)
    except (TandemError, OSError, ValueError):
        return ""
    return (f": the model store holds it, but this server does not serve it (its workers "
            f"load the models given at start): restart with `tandem serve --model "
            f"{shown(name)}`")


def _path_names(model: ServedModel) -> set[str]:
    return set(path_spellings(str(model.path))) - {model.name}


def _without_shared_path_names(models: list[ServedModel]) -> list[ServedModel]:
    """The models with every path-derived name that more than one of them has taken away."""
    derived = [{name_key(n) for n in _path_names(m)} for m in models]
    shared = {k for i, keys in enumerate(derived) for j, other in enumerate(derived)
              if i != j for k in keys & other}
    out = []
    for m in models:
        names = frozenset(n for n in m.names if not (n in _path_names(m) and name_key(n) in shared))
        out.append(m if names == m.names else dataclasses.replace(m, names=names))
    return out


def _shared_name(a: ServedModel, b: ServedModel) -> str | None:
    """A name (in any spelling) both models answer to, if any."""
    keys = {name_key(n): n for n in b.names}
    return next((n for n in sorted(a.names) if n in b.names or name_key(n) in keys), None)
