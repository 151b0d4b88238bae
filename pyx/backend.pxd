cdef str describe_arrays(dict arrays)
cdef fail(str op, str msg, dict arrays)


cdef class Backend:
    cdef readonly str name
