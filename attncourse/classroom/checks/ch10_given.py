"""The given kernel of 10-find-the-bug-1 exactly as the exercise notebook shows it (tests/test_edits.py compares
the two), and how far a fix may move from it: the check judges the source of every kernel the answer launches."""

from . import edits

BUGGY_DECODE = '''\
def decode_kernel(Q, K, V, O, T_K, H, H_KV, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)                                  # one program per (batch, query head)
    b = pid // H
    h = pid % H
    h_kv = h % H_KV                                         # the KV head this query head reads
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < HEAD_DIM
    q = tl.load(Q + pid * HEAD_DIM + dims, mask=d_ok, other=0.0)              # (BLOCK_D,) the query token
    kv = (b * H_KV + h_kv) * T_K * HEAD_DIM                                   # where that KV head's cache starts
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    scale = 1.4426950408889634 / tl.sqrt(HEAD_DIM * 1.0)                     # 1/sqrt(D), in exp2 units
    for start in range(0, T_K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        ok = cols < T_K
        k = tl.load(K + kv + cols[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.where(ok, tl.sum(k * q[None, :], 1) * scale, float("-inf"))   # (BLOCK_K,) scores
        m_new = tl.maximum(m, tl.max(s, 0))
        p = tl.exp2(s - m_new)                                                 # (BLOCK_K,)
        alpha = tl.exp2(m - m_new)
        v = tl.load(V + kv + cols[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        l = l * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)                         # (BLOCK_D,)
        m = m_new
    tl.store(O + pid * HEAD_DIM + dims, acc / l, mask=d_ok)
'''
FIX_DECODE = edits.SmallEdit(BUGGY_DECODE, most=10, lines=(5, 9), names=("G", "group", "group_size", "n_rep", "rep"))
