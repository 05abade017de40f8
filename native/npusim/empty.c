/* An empty library of the simulated CANN tree: a soname torch_npu's libraries list as NEEDED
 * (libge_runner.so and libgraph.so by libtorch_npu.so, libacl_tdt_channel.so by libtensorpipe.so)
 * without importing any name from it (nm -D --undefined-only of both: no ge::, graph or acltdt
 * name). They must load; they define nothing, so nothing can answer "success" for them. */
