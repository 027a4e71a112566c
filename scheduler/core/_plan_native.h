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

/* plan_timeline.c: a LinkTimeline's lists and eps (borrowed: kept alive by the timeline) */
typedef struct {
    PyObject *times, *residual;
    double eps;
    PyObject *tl;
} Lane;
int lane_of(PyObject *tl, Lane *out);       /* 0, or -1 (TypeError where they are not lists) */
int all_floats(PyObject *list);             /* every item an exact float */
/* plan_timeline.c: a transfer's walk and reservation; None where the Python loops are to run */
PyObject *fast_transfer(PyObject *tls, PyObject *links, double nbytes, PyObject *ready, PyObject *who, PyObject *cls);
PyObject *lanes_transfer(Lane *lanes, PyObject *links, double nbytes, PyObject *ready, PyObject *who, PyObject *cls);
/* plan_reserve.c: cls(*values) for a dataclass whose __init__ only sets `fields` */
PyObject *make_instance(PyObject *cls, PyObject *fields, PyObject *const *values, Py_ssize_t n);
/* plan_reserve.c: Timelines.link(link) for a link with no timeline yet (LinkTimeline made in C where it can) */
int make_timeline(PyObject *tls_obj, PyObject *tls, PyObject *link, PyObject *cls, double eps);
/* plan_estimate.c: where two hosts' paths to the tree's server meet (see there) */
int tree_meet(PyObject *tree, PyObject *src, PyObject *dst, PyObject **up, PyObject **down, Py_ssize_t *i,
              Py_ssize_t *j);
/* plan_routes.c: tree._dst(h), in C where it can (see there) */
PyObject *tree_dst_of(PyObject *tree, PyObject *hosts, PyObject *dsts, PyObject *h);
/* plan_estimate.c: key -> its place in a dict's order */
PyObject *places(PyObject *d);
/* plan_estimate.c: a sequence of floats as a PyMem array */
double *floats_of(PyObject *seq, Py_ssize_t *n);

/* `t` (a new tuple, or NULL), no longer tracked by the cyclic collector where it holds only
   strings and ints: such a tuple is never part of a cycle, and the collector's first pass over
   it would untrack it (_PyTuple_MaybeUntrack); the routes keep thousands of them, which that
   pass, after each cold decision, would walk first. */
static inline PyObject *untrack_atoms(PyObject *t) {
    if (t == NULL || !PyTuple_CheckExact(t) || !PyObject_GC_IsTracked(t)) return t;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(t); k++) {
        PyObject *x = PyTuple_GET_ITEM(t, k);
        if (!PyUnicode_CheckExact(x) && !PyLong_CheckExact(x)) return t;
    }
    PyObject_GC_UnTrack(t);
    return t;
}

/* whether `x` is not (or no longer) followed by the cyclic collector: no cycle runs through it */
static inline int gc_leaf(PyObject *x) { return !PyObject_IS_GC(x) || !PyObject_GC_IsTracked(x); }

/* `t` (a new tuple or tuple-subclass record such as a NamedTuple's, or NULL), no longer tracked
   by the cyclic collector where every item is a leaf (gc_leaf): it can then never be part of a
   cycle. A decision's records (its planned transfers' rows) would otherwise be walked by every
   young collection while they live, and push the old generation towards a full collection. */
static inline PyObject *untrack_leaves(PyObject *t) {
    if (t == NULL || !PyTuple_Check(t) || !PyObject_GC_IsTracked(t)) return t;
    PyTypeObject *type = Py_TYPE(t);
    if (type != &PyTuple_Type && (type->tp_dictoffset != 0 || type->tp_flags & Py_TPFLAGS_MANAGED_DICT))
        return t; /* an instance that may carry a dict of its own */
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(t); k++)
        if (!gc_leaf(PyTuple_GET_ITEM(t, k))) return t;
    PyObject_GC_UnTrack(t);
    return t;
}

/* `obj` (a new instance of a frozen record class made by make_instance, or NULL) and its
   instance dict no longer tracked by the cyclic collector where every value in that dict is a
   leaf (gc_leaf): neither can be part of a cycle then. The dict tracks itself again where a
   container is ever stored in it (as CPython's dicts do). */
static inline PyObject *untrack_record(PyObject *obj) {
    if (obj == NULL || !PyObject_GC_IsTracked(obj)) return obj;
    PyTypeObject *type = Py_TYPE(obj); /* its dict and a weakref list, nothing else in slots */
    Py_ssize_t plain = PyBaseObject_Type.tp_basicsize + (type->tp_weaklistoffset ? (Py_ssize_t)sizeof(PyObject *) : 0);
    if (!(type->tp_flags & Py_TPFLAGS_MANAGED_DICT) || type->tp_basicsize != plain || type->tp_itemsize) return obj;
    PyObject **dp = _PyObject_GetDictPtr(obj);
    if (dp == NULL || *dp == NULL || !PyDict_CheckExact(*dp)) return obj;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(*dp, &pos, &key, &value))
        if (!gc_leaf(value)) return obj;
    if (PyObject_GC_IsTracked(*dp)) PyObject_GC_UnTrack(*dp);
    PyObject_GC_UnTrack(obj);
    return obj;
}

/* d[outer][inner] of a dict of dicts (the routes' caches: destination -> source -> route), borrowed;
   NULL where missing (an error set where one occurred) */
static inline PyObject *nested_get(PyObject *d, PyObject *outer, PyObject *inner) {
    PyObject *to = PyDict_GetItemWithError(d, outer);
    if (to == NULL) return NULL;
    if (!PyDict_CheckExact(to)) {
        PyErr_SetString(PyExc_TypeError, "a route cache must be a dict of dicts");
        return NULL;
    }
    return PyDict_GetItemWithError(to, inner);
}

/* d.setdefault(outer, {})[inner] = value: 0, or -1 */
static inline int nested_set(PyObject *d, PyObject *outer, PyObject *inner, PyObject *value) {
    PyObject *to = PyDict_GetItemWithError(d, outer);
    if (to == NULL) {
        if (PyErr_Occurred() || (to = PyDict_New()) == NULL) return -1;
        int rc = PyDict_SetItem(d, outer, to);
        Py_DECREF(to);
        if (rc < 0) return -1;
    } else if (!PyDict_CheckExact(to)) {
        PyErr_SetString(PyExc_TypeError, "a route cache must be a dict of dicts");
        return -1;
    }
    return PyDict_SetItem(to, inner, value);
}

/* A heap entry of the estimate's and the reservation's loops, ordered by (key, tie, rank) as the
   Python heaps' tuples are (ties are never equal: the rank is unique). */
typedef struct {
    double key, tie;
    Py_ssize_t rank, pid;
    PyObject *ready_o, *id, *src; /* borrowed: kept alive by the caller */
} HeapEntry;

static inline int heap_less(const HeapEntry *a, const HeapEntry *b) {
    if (a->key != b->key) return a->key < b->key;
    if (a->tie != b->tie) return a->tie < b->tie;
    return a->rank < b->rank;
}

static inline void heap_push(HeapEntry *h, Py_ssize_t *n, HeapEntry e) {
    Py_ssize_t i = (*n)++;
    while (i > 0) {
        Py_ssize_t up = (i - 1) / 2;
        if (!heap_less(&e, &h[up])) break;
        h[i] = h[up];
        i = up;
    }
    h[i] = e;
}

static inline HeapEntry heap_pop(HeapEntry *h, Py_ssize_t *n) {
    HeapEntry top = h[0], e = h[--(*n)];
    Py_ssize_t i = 0, size = *n;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= size) break;
        if (c + 1 < size && heap_less(&h[c + 1], &h[c])) c++;
        if (!heap_less(&h[c], &e)) break;
        h[i] = h[c];
        i = c;
    }
    if (size > 0) h[i] = e;
    return top;
}

PyObject *py_transfer(PyObject *self, PyObject *args);
PyObject *py_ten(PyObject *self, PyObject *args);
PyObject *py_copy_timelines(PyObject *self, PyObject *args);
PyObject *py_estimate(PyObject *self, PyObject *args);
PyObject *py_reserve_tree(PyObject *self, PyObject *args);
PyObject *py_follows(PyObject *self, PyObject *args);
PyObject *py_build(PyObject *self, PyObject *args);
PyObject *py_instances(PyObject *self, PyObject *args);
PyObject *py_stf_run(PyObject *self, PyObject *args);
PyObject *py_changed_capacities(PyObject *self, PyObject *args);
PyObject *py_reserve_until(PyObject *self, PyObject *args);
PyObject *py_tree_hosts(PyObject *self, PyObject *args);
PyObject *py_tree_shape(PyObject *self, PyObject *args);
PyObject *py_tree_bottlenecks(PyObject *self, PyObject *args);
PyObject *py_tree_dst(PyObject *self, PyObject *args);
PyObject *py_decision_sends(PyObject *self, PyObject *args);
PyObject *py_dispatch_index(PyObject *self, PyObject *args);
PyObject *py_list_diff(PyObject *self, PyObject *args);
PyObject *py_tree_tables(PyObject *self, PyObject *args);
PyObject *py_update_rows(PyObject *self, PyObject *args);
PyObject *py_per_byte(PyObject *self, PyObject *args);

#endif
