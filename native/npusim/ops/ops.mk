# The simulated CANN tree's operator library, collectives and their kernel binaries, added to every
# tree this Makefile builds (found through its libacl_rt.so in ALL). Included by ../Makefile.
OPS_HDRS := ops/ops_abi.h ops/ops_list.h ops/ops_list_math.h ops/ops_list_nn.h ops/opapi_int.h ops/kern.h npusim_kernel.h ../include/npusnap/contract.h ../include/npusnap/timeutil.h
OPS_KDIR := opp/built-in/op_impl/ai_core/tbe/kernel/npusim
# The operator library: opapi.c (descriptors, executors, launch) and one file per operator family.
OPS_LIB_SRC := ops/opapi.c $(sort $(wildcard ops/op_*.c))
# The kernel binary: kernels.c (entry points) and one file per kernel family.
OPS_KERN_SRC := ops/kernels.c $(sort $(wildcard ops/k_*.c))
# -O3: loop unswitching over the dtype switches and vectorised inner loops; -flto: the element
# functions inlined into the element-wise kernel's loops. None changes a result: without
# -ffast-math GCC reorders no floating-point sum and contracts nothing into FMA (x86-64's baseline
# has none), so every element is computed by the same operations in the same order.
OPS_KERN_CFLAGS := -O3 -flto=auto

# $(call ops_tree,ROOT)
define ops_tree
$(1)/lib64/libopapi.so: $(OPS_LIB_SRC) $(OPS_HDRS) ops/ops.mk $(1)/lib64/libacl_rt.so
	$(CC) $(CFLAGS) -shared -Wl,-soname,libopapi.so -Wl,-rpath,'$$$$ORIGIN' -o $$@.tmp $(OPS_LIB_SRC) -L$(1)/lib64 -lacl_rt -ldl && mv -f $$@.tmp $$@

$(1)/lib64/libhccl.so: ops/hccl.c $(OPS_HDRS) ops/ops.mk $(1)/lib64/libacl_rt.so
	$(CC) $(CFLAGS) -shared -Wl,-soname,libhccl.so -Wl,-rpath,'$$$$ORIGIN' -o $$@.tmp ops/hccl.c -L$(1)/lib64 -lacl_rt -ldl && mv -f $$@.tmp $$@

$(1)/$(OPS_KDIR)/libnpusim_aclnn_kernels.so: $(OPS_KERN_SRC) $(OPS_HDRS) ops/ops.mk
	@mkdir -p $$(dir $$@)
	$(CC) $(CFLAGS) $(OPS_KERN_CFLAGS) -shared -o $$@.tmp $(OPS_KERN_SRC) -lm && mv -f $$@.tmp $$@

$(1)/$(OPS_KDIR)/libnpusim_hccl_kernels.so: ops/hccl_kernel.c $(OPS_HDRS) ops/ops.mk
	@mkdir -p $$(dir $$@)
	$(CC) $(CFLAGS) -shared -o $$@.tmp ops/hccl_kernel.c && mv -f $$@.tmp $$@

# The operators' headers, where a CANN install keeps them (include/aclnnop/aclnn_*.h).
$(1)/include/aclnn/acl_meta.h: $(OPS_LIB_SRC) ops/gen_headers.py ops/ops.mk
	rm -rf $(1)/include/aclnnop && python3 ops/gen_headers.py $(1)/include "$(CC)" $(sort $(wildcard ops/op_*.c))

OPS_ALL += $(1)/lib64/libopapi.so $(1)/lib64/libhccl.so $(1)/$(OPS_KDIR)/libnpusim_aclnn_kernels.so \
           $(1)/$(OPS_KDIR)/libnpusim_hccl_kernels.so $(1)/include/aclnn/acl_meta.h
endef

OPS_TREES := $(patsubst %/lib64/libacl_rt.so,%,$(filter %/lib64/libacl_rt.so,$(ALL)))
$(foreach t,$(OPS_TREES),$(eval $(call ops_tree,$(t))))
all: $(OPS_ALL)
