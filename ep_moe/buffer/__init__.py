"""DeepEP's V1 buffer and what it is made of (`ep_moe.Buffer` is the public name of `buffer_v1.Buffer`).

Modules, bottom to top: `dispatch_handle` (`DispatchHandle`), `event_overlap` (`EventOverlap`), `routing_layout`
(dispatch layout and receiver view in torch ops), `argument_checks` (checks whose errors name the argument);
`buffer_v1` (`Buffer`: streams, events, backend choice); `autograd_ops` (differentiable dispatch, combine,
cached dispatch) and `expert_major_ops` (the same in the expert-major layout). This file imports nothing: the
backends below `Buffer` import its bottom modules without loading `Buffer`.
"""
