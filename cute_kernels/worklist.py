"""Column names of the two int32 tables the host planner writes and the kernels read.

The planner (``planner.py``), the attention kernel (``attention_sm90.py``), the split-KV
combine (``combine_sm90.py``) and ``DevicePlan`` all index these tables through the names
below; no column number is written anywhere else.  Semantics: docs/contract.md.
"""

# ---- work list: one row per item (request, KV head, q tile, KV range) ----------------------
REQ = 0      # request b
HEAD = 1     # KV head h
QSTART = 2   # first new token of the tile, relative to the request's first new token
QLEN = 3     # new tokens in the tile
P0 = 4       # first KV page (fused writeback: KV unit), inclusive
P1 = 5       # last KV page (unit), exclusive
SPLIT = 6    # split index within the (request, head, q tile) group, 0 when unsplit
NSPLIT = 7   # splits of that group; 1 writes ``out`` directly
QHEAD = 8    # -1: packed tile (Gp q heads x tokens); g >= 0: unpacked tile of q head h*G + g
WORK_COLS = 9

# ---- combine groups: one row per split (request, head, token range) ------------------------
C_REQ = 0
C_HEAD = 1
C_TOK0 = 2    # first token of the group, relative to the request's first new token
C_NTOK = 3    # tokens of the group (0: padding row)
C_NSPLIT = 4  # splits to merge
C_BASE = 5    # first workspace row of the group
COMBINE_COLS = 6
