import numpy as np
import pytest

from checkers.invariants import check_tree
from tests.factories import make_tree


def toks(*xs):
    return np.asarray(xs, dtype=np.uint32)


def insert(tree, tokens, ns=None):
    """Insert via walk + add_child (tree-level only; tiers are the facade's business)."""
    t = toks(*tokens)
    path, pos = tree.walk(t, ns)
    parent = path[-1] if path else tree.root(ns)
    if pos < len(t):
        child = tree.add_child(parent, t[pos:].copy())
        child.l1 = np.zeros(len(child.tokens) // tree.page_size, dtype=np.int64)
        parent.n_l1_children += 1
        return child
    return parent


def test_match_is_page_aligned_and_splits():
    tree = make_tree(page_size=2)
    a = insert(tree, [1, 2, 3, 4, 5, 6])
    assert tree.num_nodes == 1
    path, n = tree.walk(toks(1, 2, 3, 9, 9, 9), None)
    assert n == 2  # 1,2 matches; 3 matches but the page (3,4) does not
    assert len(path) == 1 and path[0].tokens.tolist() == [1, 2]
    assert tree.num_nodes == 2  # split into [1,2] -> [3,4,5,6]
    assert a.tokens.tolist() == [3, 4, 5, 6] and a.parent is path[0]
    assert not check_tree(tree)


def test_partial_last_page_is_ignored():
    tree = make_tree(page_size=4)
    insert(tree, [1, 2, 3, 4, 5, 6, 7, 8])
    path, n = tree.walk(toks(1, 2, 3, 4, 5, 6, 7), None)
    assert n == 4 and [p.tokens.tolist() for p in path] == [[1, 2, 3, 4]]


def test_children_are_found_by_first_page():
    tree = make_tree(page_size=1)
    insert(tree, [1, 2, 3])
    insert(tree, [1, 5, 6])
    insert(tree, [7])
    root = tree.root(None)
    assert sorted(np.frombuffer(k, dtype=np.uint32)[0] for k in root.children) == [1, 7]
    path, n = tree.walk(toks(1, 5, 6, 8), None)
    assert n == 3 and [p.tokens.tolist() for p in path] == [[1], [5, 6]]
    assert not check_tree(tree)


def test_namespaces_never_share_nodes():
    tree = make_tree(page_size=2)
    insert(tree, [1, 2, 3, 4], ns="lora-a")
    path, n = tree.walk(toks(1, 2, 3, 4), None)
    assert n == 0 and path == []
    path, n = tree.walk(toks(1, 2, 3, 4), "lora-b")
    assert n == 0
    path, n = tree.walk(toks(1, 2, 3, 4), "lora-a")
    assert n == 4
    assert set(tree.roots) == {"lora-a", None, "lora-b"} or set(tree.roots) >= {"lora-a"}


def test_ids_are_deterministic():
    def build():
        tree = make_tree(page_size=2)
        for seq in ([1, 2, 3, 4], [1, 2, 5, 6], [9, 9]):
            insert(tree, seq)
        tree.walk(toks(1, 2, 3, 4), None)
        return sorted((n.id, n.tokens.tolist()) for n in tree.iter_nodes())

    assert build() == build()


def test_remove_leaf_only_removes_leaves():
    tree = make_tree(page_size=1)
    insert(tree, [1, 2])
    insert(tree, [1, 3])
    path, _ = tree.walk(toks(1), None)
    with pytest.raises(AssertionError):
        tree.remove_leaf(path[0])
    leaf = tree.walk(toks(1, 2), None)[0][-1]
    leaf.parent.n_l1_children -= 1
    tree.remove_leaf(leaf)
    assert tree.walk(toks(1, 2), None)[1] == 1
    assert not check_tree(tree)


def test_page_size_zero_rejected():
    with pytest.raises(ValueError):
        make_tree(page_size=0)
