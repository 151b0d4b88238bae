cdef str describe_arrays(dict arrays)
cdef fail(str op, str msg, dict arrays)


cdef class Backend:
    cdef readonly str name
    cdef readonly object kernels         # the pyx.kernel_config.KernelConfig it was built with
    cdef readonly object xp, act_dtype
    cdef readonly bint batch_invariant
    cdef public bint fused_moe, fused_sampling
