"""Static draft trees as vLLM spells them (`speculative_token_tree`).

A tree is a list of paths from the last verified token: `(0,)` is the top-1 draft after it, `(1,)` the top-2,
`(0, 1)` the top-2 draft after the top-1 one, and so on. Every path's parent (the path without its last
entry) must be in the list too. vLLM writes the list as a string ("[(0,), (1,), (0, 0)]") and sorts it by
depth, then path; so do we, which puts every parent before its children: any prefix of the nodes is itself a
tree, so a step that may verify fewer nodes keeps the first ones.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenTree:
    paths: tuple[tuple[int, ...], ...]  # by depth, then path
    parents: tuple[int, ...]  # node index of each node's parent, -1 for the last verified token
    depths: tuple[int, ...]  # 1 for the root's children
    ranks: tuple[int, ...]  # the node's rank among its depth's candidates (the path's last entry)

    @classmethod
    def parse(cls, spec: str | list) -> TokenTree:
        """A tree from vLLM's spelling (a string of a list of tuples, or the list itself); ValueError with one
        line naming what is wrong otherwise."""
        if isinstance(spec, str):
            try:
                spec = ast.literal_eval(spec)
            except (ValueError, SyntaxError):
                raise ValueError(f"speculative_token_tree {spec!r}: not a list of tuples such as "
                                 "\"[(0,), (1,), (0, 0)]\"") from None
        if not isinstance(spec, (list, tuple)) or not spec:
            raise ValueError("speculative_token_tree: a non-empty list of paths such as [(0,), (1,), (0, 0)]")
        paths = []
        for path in spec:
            if not isinstance(path, (list, tuple)) or not path or \
                    not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in path):
                raise ValueError(f"speculative_token_tree path {path!r}: a non-empty tuple of ranks >= 0")
            paths.append(tuple(path))
        if len(set(paths)) < len(paths):
            repeated = next(p for p in paths if paths.count(p) > 1)
            raise ValueError(f"speculative_token_tree: path {repeated} appears twice")
        paths.sort(key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(paths)}
        missing = [p for p in paths if len(p) > 1 and p[:-1] not in index]
        if missing:
            raise ValueError(f"speculative_token_tree: path {missing[0]} has no parent {missing[0][:-1]} in the tree")
        return cls(paths=tuple(paths), parents=tuple(index[p[:-1]] if len(p) > 1 else -1 for p in paths),
                   depths=tuple(len(p) for p in paths), ranks=tuple(p[-1] for p in paths))

    @classmethod
    def chain(cls, length: int) -> TokenTree:
        return cls.parse([(0,) * d for d in range(1, length + 1)])

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def top_k(self) -> int:
        """The candidates each depth needs: its highest rank + 1."""
        return max(self.ranks) + 1

    def parent_tensor(self, rows: int, device) -> torch.Tensor:
        return torch.tensor(self.parents, dtype=torch.long, device=device).expand(rows, -1)
