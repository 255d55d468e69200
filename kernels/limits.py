"""The kernels' size limits, free of Triton so that ``bole`` reads them on any machine."""

# Nodes of one request's verified tree, root included: the verifier's limit (four 64-row chunks of
# ancestor bitmasks, kernels/gdn_tree_verify.py).
MAX_TREE_NODES = 256
# Nodes of one tree the layout kernel takes: it keeps a node's ancestor set in up to four 64-bit words.
LAYOUT_MAX_NODES = 256
