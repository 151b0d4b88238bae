cdef class Backend:
    cdef readonly str name
