"""The kernels' torch twins, the executable specification: kernels/X.py's entry point ``f`` is ``f_ref`` here
(tests/kernels/test_twins.py), in the module below.

    kernels/act_mul.py                  activation.py    act_mul_ref
    kernels/causal_conv1d.py            conv.py          causal_conv1d_varlen_ref
    kernels/gdn_commit.py               gdn.py           gdn_commit_ref
    kernels/gdn_decode.py               gdn_decode.py    causal_conv1d_update_ref, gdn_decode_step_ref
    kernels/gdn_recurrent.py            gdn.py           gdn_recurrent_ref
    kernels/gdn_tree_conv.py            conv.py          causal_conv1d_tree_ref, gdn_tree_conv_ref
    kernels/gdn_tree_serial.py          gdn.py           gdn_tree_serial_ref
    kernels/gdn_tree_verify.py          gdn.py           gdn_tree_verify_ref
    kernels/greedy_accept.py            accept.py        greedy_accept_ref
    kernels/logits_topk.py              topk.py          log_softmax_topk_ref
    kernels/moe_experts.py              moe.py           moe_experts_ref
    kernels/paged_decode_attention.py   attention.py     paged_decode_attention_ref
    kernels/qk_norm_rope.py             rope.py          qk_norm_rope_store_ref
    kernels/rmsnorm.py                  norm.py          rms_norm_ref, gated_rms_norm_ref
    kernels/tree_attention.py           attention.py     tree_attention_ref
    kernels/tree_layout.py              tree_layout.py   tree_layout_ref

gdn_chunk.py (the chunked prefill, fla's twin) and gdn_inputs.py (verifier test inputs) have no kernel here.
"""
