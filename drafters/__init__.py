"""Drafters: everything that proposes token trees (draft LMs, early-exit heads, n-gram lookup).

The proposer interface and its implementations land with the speculative core; trees are
`specserve.tree.TokenTree`.
"""
