/* Shared by the files of mlfabric.scheduler.core._plan_native (see _plan_native.c). */
#ifndef MLF_PLAN_NATIVE_H
#define MLF_PLAN_NATIVE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LINKS 64 /* links of one path */

/* interned attribute names and constants (made by the module's init) */
extern PyObject *str_aggregator, *str_parent, *str_members, *str_free, *str_per, *str_grow, *str_hosts,
    *str_dsts, *str_host, *str_dst_m, *str_pair_ids, *str_path, *str_up, *str_pos, *str_down, *str_server,
    *str_tree, *empty_tuple, *str_walks, *str_back, *str_pair_path, *str_links, *str_link, *str_transfer,
    *str_end, *str_update_id, *str_src, *a_transfer, *str_start, *str_payload_id, *str_times, *str_residual,
    *str_eps, *fmt_over;

/* plan_timeline.c: a transfer's walk and reservation; None where the Python loops are to run */
PyObject *fast_transfer(PyObject *tls, PyObject *links, double nbytes, PyObject *ready, PyObject *who, PyObject *cls);
/* plan_reserve.c: cls(*values) for a dataclass whose __init__ only sets `fields` */
PyObject *make_instance(PyObject *cls, PyObject *fields, PyObject *const *values, Py_ssize_t n);
/* plan_estimate.c: a sequence of floats as a PyMem array */
double *floats_of(PyObject *seq, Py_ssize_t *n);

PyObject *py_transfer(PyObject *self, PyObject *args);
PyObject *py_estimate(PyObject *self, PyObject *args);
PyObject *py_reserve_tree(PyObject *self, PyObject *args);
PyObject *py_follows(PyObject *self, PyObject *args);
PyObject *py_build(PyObject *self, PyObject *args);
PyObject *py_instances(PyObject *self, PyObject *args);

#endif
