/* mlfabric.scheduler.core._plan_native: tree_cost.reserve (see _plan_native.c). */
#include "_plan_native.h"

/* ------------------------------------------------------------------ tree_cost.reserve */


/* routes.tree_path(src, dst) (new reference): _ServerRoutes.walks, else pair_path's route (C
   where the paths meet in the tree, the method where it goes round), stored as pair_path does */
static PyObject *tree_path(PyObject *tree, PyObject *walks, PyObject *src, PyObject *dst) {
    PyObject *out = nested_get(walks, dst, src);
    if (out != NULL || PyErr_Occurred()) {
        Py_XINCREF(out);
        return out;
    }
    PyObject *up = NULL, *down = NULL, *up_path = NULL, *back = NULL;
    int same = PyUnicode_Compare(src, dst) == 0;
    if (PyErr_Occurred()) goto done;
    if (same) {
        out = PyTuple_Pack(1, src);
        goto done;
    }
    Py_ssize_t i, j;
    int meet = tree_meet(tree, src, dst, &up, &down, &i, &j);
    if (meet < 0) goto done;
    if (meet == 0) {
        out = PyObject_CallMethodObjArgs(tree, str_pair_path, src, dst, NULL);
        goto done;
    }
    if ((up_path = PyObject_GetAttr(up, str_path)) == NULL) goto done;
    if (meet == 1) {
        out = up_path;
        Py_INCREF(out);
    } else {
        if ((back = PyObject_GetAttr(down, str_back)) == NULL) goto done;
        if (!PyTuple_CheckExact(back)) {
            PyErr_SetString(PyExc_TypeError, "tree_path: unexpected route types");
            goto done;
        }
        /* up.path[:i] + down.back[len(down.back) - 1 - j :] */
        Py_ssize_t nb = PyTuple_GET_SIZE(back), from = nb - 1 - j;
        if ((out = PyTuple_New(i + (nb - from))) == NULL) goto done;
        for (Py_ssize_t k = 0; k < i; k++) {
            PyObject *x = PyTuple_GET_ITEM(up_path, k);
            Py_INCREF(x);
            PyTuple_SET_ITEM(out, k, x);
        }
        for (Py_ssize_t k = from; k < nb; k++) {
            PyObject *x = PyTuple_GET_ITEM(back, k);
            Py_INCREF(x);
            PyTuple_SET_ITEM(out, i + k - from, x);
        }
    }
    if (nested_set(walks, dst, src, untrack_atoms(out)) < 0) Py_CLEAR(out);
done:
    Py_XDECREF(up);
    Py_XDECREF(down);
    Py_XDECREF(up_path);
    Py_XDECREF(back);
    return out;
}

/* cls(*values) for a dataclass whose __init__ only sets `fields` (no __post_init__): the instance's
   dict filled in field order, as __init__ fills it (new reference); cls(*values) where `fields`
   is None */
PyObject *make_instance(PyObject *cls, PyObject *fields, PyObject *const *values, Py_ssize_t n) {
    if (fields == Py_None || !PyType_Check(cls)) return PyObject_Vectorcall(cls, values, n, NULL);
    if (!PyTuple_CheckExact(fields) || PyTuple_GET_SIZE(fields) < n) {
        PyErr_SetString(PyExc_TypeError, "make_instance: fields must name every value");
        return NULL;
    }
    PyObject *obj = PyBaseObject_Type.tp_new((PyTypeObject *)cls, empty_tuple, NULL);
    if (obj == NULL) return NULL;
    PyObject *dict = PyObject_GenericGetDict(obj, NULL);
    if (dict == NULL) {
        Py_DECREF(obj);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (PyDict_SetItem(dict, PyTuple_GET_ITEM(fields, k), values[k]) < 0) {
            Py_DECREF(dict);
            Py_DECREF(obj);
            return NULL;
        }
    }
    Py_DECREF(dict);
    return obj;
}

static PyObject *str_profiles, *str_graph, *str_adj, *str_capacity, *str_start_, *str_times_, *str_residual_,
    *str_eps_;

/* Timelines.link(link) where the link has no timeline yet: LinkTimeline(capacity, start) made
   here where the timelines have no capacity profiles (its slots set as its __init__ sets them,
   eps = `eps` * capacity), else by the method (which raises for a link not in the graph). 0 or -1. */
int make_timeline(PyObject *tls_obj, PyObject *tls, PyObject *link, PyObject *cls, double eps) {
    if (str_profiles == NULL) {
        str_profiles = PyUnicode_InternFromString("_profiles");
        str_graph = PyUnicode_InternFromString("_graph");
        str_adj = PyUnicode_InternFromString("_adj");
        str_capacity = PyUnicode_InternFromString("capacity");
        str_start_ = PyUnicode_InternFromString("_start");
        str_times_ = PyUnicode_InternFromString("times");
        str_residual_ = PyUnicode_InternFromString("residual");
        str_eps_ = PyUnicode_InternFromString("eps");
        if (!str_profiles || !str_graph || !str_adj || !str_capacity || !str_start_ || !str_times_ ||
            !str_residual_ || !str_eps_)
            return -1;
    }
    PyObject *profiles = NULL, *graph = NULL, *adj = NULL, *start = NULL, *obj = NULL, *l = NULL;
    int rc = -1, fast = 0;
    double cap = 0.0;
    if (cls == Py_None || !PyType_Check(cls)) goto slow;
    if ((profiles = PyObject_GetAttr(tls_obj, str_profiles)) == NULL) goto done;
    int busy = PyObject_IsTrue(profiles);
    if (busy < 0) goto done;
    if (busy) goto slow;
    if ((graph = PyObject_GetAttr(tls_obj, str_graph)) == NULL) goto done;
    adj = PyObject_GetAttr(graph, str_adj);
    if (adj == NULL) {
        PyErr_Clear();
        goto slow;
    }
    if (!PyDict_Check(adj)) goto slow;
    PyObject *nbrs = PyDict_GetItemWithError(adj, PyTuple_GET_ITEM(link, 0));
    if (nbrs == NULL || !PyDict_Check(nbrs)) goto slow_clear;
    PyObject *data = PyDict_GetItemWithError(nbrs, PyTuple_GET_ITEM(link, 1));
    if (data == NULL || !PyDict_Check(data)) goto slow_clear;
    PyObject *cap_o = PyDict_GetItemWithError(data, str_capacity);
    if (cap_o == NULL || !(PyFloat_CheckExact(cap_o) || PyLong_CheckExact(cap_o))) goto slow_clear;
    cap = PyFloat_AsDouble(cap_o);
    if (cap == -1.0 && PyErr_Occurred()) goto slow_clear;
    fast = 1;
slow_clear:
    if (PyErr_Occurred()) goto done;
slow:
    if (!fast) {
        PyObject *tl = PyObject_CallMethodOneArg(tls_obj, str_link, link);
        if (tl == NULL) goto done;
        Py_DECREF(tl);
        rc = 0;
        goto done;
    }
    if ((start = PyObject_GetAttr(tls_obj, str_start_)) == NULL) goto done;
    if ((obj = PyBaseObject_Type.tp_new((PyTypeObject *)cls, empty_tuple, NULL)) == NULL) goto done;
    if ((l = PyList_New(1)) == NULL) goto done;
    Py_INCREF(start);
    PyList_SET_ITEM(l, 0, start);
    if (PyObject_SetAttr(obj, str_times_, l) < 0) goto done;
    Py_SETREF(l, PyList_New(1));
    if (l == NULL) goto done;
    PyObject *c = PyFloat_FromDouble(cap);
    if (c == NULL) goto done;
    PyList_SET_ITEM(l, 0, c);
    if (PyObject_SetAttr(obj, str_residual_, l) < 0) goto done;
    PyObject *e = PyFloat_FromDouble(eps * cap);
    if (e == NULL) goto done;
    int set = PyObject_SetAttr(obj, str_eps_, e);
    Py_DECREF(e);
    if (set < 0 || PyDict_SetItem(tls, link, obj) < 0) goto done;
    rc = 0;
done:
    Py_XDECREF(profiles);
    Py_XDECREF(graph);
    Py_XDECREF(adj);
    Py_XDECREF(start);
    Py_XDECREF(obj);
    Py_XDECREF(l);
    return rc;
}

/* Timelines.transfer(pid, hops, nbytes, ready) (new reference): C where it can, the method else */
static PyObject *one_transfer(PyObject *tls_obj, PyObject *tls, PyObject *hops, PyObject *pid, PyObject *nbytes_o,
                              PyObject *ready, PyObject *transfer_cls, PyObject *reservation_cls, PyObject *fields,
                              PyObject *timeline_cls, double eps) {
    Py_ssize_t nh = PyTuple_GET_SIZE(hops);
    PyObject *links = PyTuple_New(nh > 1 ? nh - 1 : 0);
    if (links == NULL) return NULL;
    for (Py_ssize_t k = 0; k + 1 < nh; k++) {
        PyObject *link = PyTuple_Pack(2, PyTuple_GET_ITEM(hops, k), PyTuple_GET_ITEM(hops, k + 1));
        if (link == NULL) {
            Py_DECREF(links);
            return NULL;
        }
        PyTuple_SET_ITEM(links, k, link);
    }
    double nbytes = PyFloat_AsDouble(nbytes_o);
    int truthy = PyObject_IsTrue(pid);
    if ((nbytes == -1.0 || truthy < 0) && PyErr_Occurred()) {
        Py_DECREF(links);
        return NULL;
    }
    PyObject *who = truthy ? pid : a_transfer;
    PyObject *got = NULL;
    for (int attempt = 0; attempt < 2; attempt++) {
        got = fast_transfer(tls, links, nbytes, ready, who, reservation_cls);
        if (got != Py_None) break;
        Py_DECREF(got);
        got = NULL;
        if (attempt == 1) break;
        int made = 0; /* make the missing timelines, in path order (as the walk would) */
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(links); k++) {
            PyObject *link = PyTuple_GET_ITEM(links, k);
            int has = PyDict_Contains(tls, link);
            if (has < 0) {
                Py_DECREF(links);
                return NULL;
            }
            if (!has) {
                if (make_timeline(tls_obj, tls, link, timeline_cls, eps) < 0) {
                    Py_DECREF(links);
                    return NULL;
                }
                made = 1;
            }
        }
        if (!made) break;
    }
    if (got == NULL && PyErr_Occurred()) {
        Py_DECREF(links);
        return NULL;
    }
    PyObject *out;
    if (got == NULL) { /* the Python loops (they raise where the path never has residual bandwidth) */
        out = PyObject_CallMethodObjArgs(tls_obj, str_transfer, pid, hops, nbytes_o, ready, NULL);
    } else {
        PyObject *argv[9] = {pid,
                             PyTuple_GET_ITEM(hops, 0),
                             PyTuple_GET_ITEM(hops, nh - 1),
                             hops,
                             PyTuple_GET_ITEM(got, 0),
                             PyTuple_GET_ITEM(got, 1),
                             nbytes_o,
                             PyTuple_GET_ITEM(got, 2),
                             Py_False};
        out = make_instance(transfer_cls, fields, argv, fields == Py_None ? 8 : 9);
        Py_DECREF(got);
    }
    Py_DECREF(links);
    return out;
}

PyObject *py_reserve_tree(PyObject *self, PyObject *args) {
    PyObject *tls_obj, *routes, *order, *nodes, *parent, *server, *size, *readies, *now, *transfer_cls, *res_cls;
    PyObject *fields, *timeline_cls;
    double eps;
    if (!PyArg_ParseTuple(args, "OOO!O!O!OO!O!OOOOOd", &tls_obj, &routes, &PyList_Type, &order, &PyDict_Type, &nodes,
                          &PyDict_Type, &parent, &server, &PyDict_Type, &size, &PyList_Type, &readies, &now,
                          &transfer_cls, &res_cls, &fields, &timeline_cls, &eps))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(order), na = PyDict_GET_SIZE(nodes);
    if (PyList_GET_SIZE(readies) != n) {
        PyErr_SetString(PyExc_ValueError, "reserve_tree: one ready time per update");
        return NULL;
    }
    PyObject *tls = NULL, *tree = NULL, *walks = NULL, *pos = NULL, *transfers = NULL, *out = NULL;
    PyObject *makespan = now;
    Py_INCREF(makespan);
    PyObject **agg_host = PyMem_Calloc(na ? na : 1, sizeof(PyObject *));
    PyObject **agg_ready_o = PyMem_Calloc(na ? na : 1, sizeof(PyObject *));
    PyObject **agg_id = PyMem_Calloc(na ? na : 1, sizeof(PyObject *)); /* borrowed from nodes */
    double *agg_ready = PyMem_Malloc((na ? na : 1) * sizeof(double));
    double *ready_d = PyMem_Malloc((n ? n : 1) * sizeof(double));
    Py_ssize_t *waiting = PyMem_Malloc((na ? na : 1) * sizeof(Py_ssize_t));
    HeapEntry *heap = PyMem_Malloc((na ? na : 1) * sizeof(HeapEntry));
    if (!agg_host || !agg_ready_o || !agg_id || !agg_ready || !ready_d || !waiting || !heap) {
        PyErr_NoMemory();
        goto done;
    }
    if ((tls = PyObject_GetAttr(tls_obj, str_links)) == NULL) goto done;
    if (!PyDict_CheckExact(tls)) {
        PyErr_SetString(PyExc_TypeError, "reserve_tree: the timelines' links must be a dict");
        goto done;
    }
    if ((tree = PyObject_GetAttr(routes, str_tree)) == NULL) goto done;
    if ((walks = PyObject_GetAttr(tree, str_walks)) == NULL) goto done;
    if (!PyDict_CheckExact(walks)) {
        PyErr_SetString(PyExc_TypeError, "reserve_tree: the routes' walks must be a dict");
        goto done;
    }
    if ((pos = places(nodes)) == NULL) goto done;
    if ((transfers = PyList_New(0)) == NULL) goto done;
    {
        Py_ssize_t it = 0, k = 0;
        PyObject *aid, *node;
        while (PyDict_Next(nodes, &it, &aid, &node)) {
            agg_id[k] = aid;
            if ((agg_host[k] = PyObject_GetAttr(node, str_aggregator)) == NULL) goto done;
            PyObject *members = PyObject_GetAttr(node, str_members);
            if (members == NULL) goto done;
            waiting[k] = PyObject_Length(members);
            Py_DECREF(members);
            if (waiting[k] < 0) goto done;
            agg_ready[k] = -INFINITY;
            k++;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        ready_d[i] = PyFloat_AsDouble(PyList_GET_ITEM(readies, i));
        if (ready_d[i] == -1.0 && PyErr_Occurred()) goto done;
    }
    double makespan_d = PyFloat_AsDouble(now);
    if (makespan_d == -1.0 && PyErr_Occurred()) goto done;
    Py_ssize_t hn = 0, i = 0;
    Py_ssize_t made = 0;
    while (i < n || hn) {
        PyObject *ready_o, *pid, *src;
        if (hn && (i >= n || heap[0].key < ready_d[i])) {
            HeapEntry e = heap_pop(heap, &hn);
            ready_o = e.ready_o;
            Py_INCREF(ready_o);
            pid = e.id;
            Py_INCREF(pid);
            src = e.src;
            Py_INCREF(src);
        } else {
            PyObject *u = PyList_GET_ITEM(order, i);
            ready_o = PyList_GET_ITEM(readies, i);
            Py_INCREF(ready_o);
            i++;
            pid = PyObject_GetAttr(u, str_update_id);
            src = pid == NULL ? NULL : PyObject_GetAttr(u, str_src);
            if (src == NULL) {
                Py_XDECREF(pid);
                Py_DECREF(ready_o);
                goto done;
            }
        }
        PyObject *to = PyDict_GetItemWithError(parent, pid);
        Py_ssize_t k = -1;
        PyObject *hop = server;
        if (to != NULL) {
            PyObject *idx = PyDict_GetItemWithError(pos, to);
            if (idx == NULL) {
                if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, to);
            } else {
                k = PyLong_AsSsize_t(idx);
                hop = agg_host[k];
            }
        }
        PyObject *t = NULL, *nbytes_o = NULL, *hops = NULL;
        if (!PyErr_Occurred()) {
            nbytes_o = PyDict_GetItemWithError(size, pid);
            if (nbytes_o == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, pid);
        }
        if (nbytes_o != NULL) hops = tree_path(tree, walks, src, hop);
        if (hops != NULL && !PyTuple_CheckExact(hops)) {
            PyErr_SetString(PyExc_TypeError, "reserve_tree: a path must be a tuple");
            Py_CLEAR(hops);
        }
        if (hops != NULL) t = one_transfer(tls_obj, tls, hops, pid, nbytes_o, ready_o, transfer_cls, res_cls, fields, timeline_cls,
                                          eps);
        Py_XDECREF(hops);
        Py_DECREF(ready_o);
        Py_DECREF(pid);
        Py_DECREF(src);
        if (t == NULL) goto done;
        int rc = PyList_Append(transfers, t);
        PyObject *end_o = PyObject_GetAttr(t, str_end);
        Py_DECREF(t);
        if (rc < 0 || end_o == NULL) {
            Py_XDECREF(end_o);
            goto done;
        }
        double end = PyFloat_AsDouble(end_o);
        if (end == -1.0 && PyErr_Occurred()) {
            Py_DECREF(end_o);
            goto done;
        }
        if (k < 0) {
            if (end > makespan_d) {
                makespan_d = end;
                Py_SETREF(makespan, end_o);
            } else {
                Py_DECREF(end_o);
            }
            continue;
        }
        waiting[k] -= 1;
        if (end > agg_ready[k]) {
            agg_ready[k] = end;
            Py_XSETREF(agg_ready_o[k], end_o);
        } else {
            Py_DECREF(end_o);
        }
        if (waiting[k] == 0) {
            made += 1;
            /* (ready, made, id, aggregator): the made count breaks ties */
            HeapEntry e = {agg_ready[k], 0.0, made, k, agg_ready_o[k], agg_id[k], agg_host[k]};
            heap_push(heap, &hn, e);
        }
    }
    out = PyTuple_Pack(2, transfers, makespan);
done:
    if (agg_host != NULL)
        for (Py_ssize_t k = 0; k < na; k++) Py_XDECREF(agg_host[k]);
    if (agg_ready_o != NULL)
        for (Py_ssize_t k = 0; k < na; k++) Py_XDECREF(agg_ready_o[k]);
    PyMem_Free(agg_host);
    PyMem_Free(agg_ready_o);
    PyMem_Free(agg_id);
    PyMem_Free(agg_ready);
    PyMem_Free(ready_d);
    PyMem_Free(waiting);
    PyMem_Free(heap);
    Py_XDECREF(tls);
    Py_XDECREF(tree);
    Py_XDECREF(walks);
    Py_XDECREF(pos);
    Py_XDECREF(transfers);
    Py_XDECREF(makespan);
    return out;
}

/* instances(cls, fields, rows) -> list: make_instance(cls, fields, row) for each row (a tuple
   naming every field, in order) */
PyObject *py_instances(PyObject *self, PyObject *args) {
    PyObject *cls, *fields, *rows;
    if (!PyArg_ParseTuple(args, "OO!O!", &cls, &PyTuple_Type, &fields, &PyList_Type, &rows)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(rows), nf = PyTuple_GET_SIZE(fields);
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != nf) {
            PyErr_SetString(PyExc_TypeError, "instances: each row must be a tuple of every field");
            Py_DECREF(out);
            return NULL;
        }
        PyObject *obj = make_instance(cls, fields, &PyTuple_GET_ITEM(row, 0), nf);
        if (obj == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, obj);
    }
    return out;
}
