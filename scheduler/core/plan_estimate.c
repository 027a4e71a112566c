/* mlfabric.scheduler.core._plan_native: tree_cost.estimate and the tree's routes (see _plan_native.c). */
#include "_plan_native.h"

/* ------------------------------------------------------------------ tree_cost.estimate */

double *floats_of(PyObject *seq, Py_ssize_t *n) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of floats");
    if (fast == NULL) return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    double *out = PyMem_Malloc((len ? len : 1) * sizeof(double));
    if (out == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < len; i++) {
        out[i] = PyFloat_AsDouble(items[i]);
        if (out[i] == -1.0 && PyErr_Occurred()) {
            PyMem_Free(out);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    *n = len;
    return out;
}



/* key -> its place (0, 1, ...) in the dict `d`'s order (a new dict) */
PyObject *places(PyObject *d) {
    PyObject *out = PyDict_New();
    Py_ssize_t it = 0, k = 0;
    PyObject *key, *value;
    while (out != NULL && PyDict_Next(d, &it, &key, &value)) {
        PyObject *idx = PyLong_FromSsize_t(k++);
        if (idx == NULL || PyDict_SetItem(out, key, idx) < 0) Py_CLEAR(out);
        Py_XDECREF(idx);
    }
    return out;
}

/* Where the paths of `src` and `dst` to the tree's server meet (_ServerRoutes._meet), their
   _Host / _Dst made by the tree's methods where missing: 1 with *up (new reference) where dst
   is the server; 2 with *up, *down (new references), *i (on src's path) and *j (on dst's) where
   they meet within the links down to dst; 0 where they do not (the route goes round); -1 on
   error. */
int tree_meet(PyObject *tree, PyObject *src, PyObject *dst, PyObject **up, PyObject **down, Py_ssize_t *i,
              Py_ssize_t *j) {
    PyObject *hosts = NULL, *server = NULL, *dsts = NULL, *up_path = NULL, *pos = NULL, *down_ids = NULL;
    int rc = -1;
    *up = *down = NULL;
    if ((hosts = PyObject_GetAttr(tree, str_hosts)) == NULL) goto done;
    *up = PyDict_GetItemWithError(hosts, src);
    if (*up != NULL) {
        Py_INCREF(*up);
    } else {
        if (PyErr_Occurred()) goto done;
        if ((*up = PyObject_CallMethodOneArg(tree, str_host, src)) == NULL) goto done;
    }
    if ((server = PyObject_GetAttr(tree, str_server)) == NULL) goto done;
    int is_server = PyUnicode_Compare(dst, server) == 0;
    if (PyErr_Occurred()) goto done;
    if (is_server) {
        rc = 1;
        goto done;
    }
    if ((dsts = PyObject_GetAttr(tree, str_dsts)) == NULL) goto done;
    *down = PyDict_GetItemWithError(dsts, dst);
    if (*down != NULL) {
        Py_INCREF(*down);
    } else {
        if (PyErr_Occurred()) goto done;
        if ((*down = tree_dst_of(tree, hosts, dsts, dst)) == NULL) goto done;
    }
    if ((up_path = PyObject_GetAttr(*up, str_path)) == NULL) goto done;
    if ((pos = PyObject_GetAttr(*down, str_pos)) == NULL) goto done;
    if ((down_ids = PyObject_GetAttr(*down, str_down)) == NULL) goto done;
    if (!PyTuple_CheckExact(up_path) || !PyTuple_CheckExact(down_ids) || !PyDict_CheckExact(pos)) {
        PyErr_SetString(PyExc_TypeError, "tree_meet: unexpected route types");
        goto done;
    }
    *i = *j = -1;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(up_path); k++) {
        PyObject *jo = PyDict_GetItemWithError(pos, PyTuple_GET_ITEM(up_path, k));
        if (jo != NULL) {
            *i = k;
            *j = PyLong_AsSsize_t(jo);
            break;
        }
        if (PyErr_Occurred()) goto done;
    }
    rc = *i < 0 || *j > PyTuple_GET_SIZE(down_ids) ? 0 : 2;
done:
    if (rc < 0 || rc == 0) {
        Py_CLEAR(*up);
        Py_CLEAR(*down);
    }
    Py_XDECREF(hosts);
    Py_XDECREF(server);
    Py_XDECREF(dsts);
    Py_XDECREF(up_path);
    Py_XDECREF(pos);
    Py_XDECREF(down_ids);
    return rc;
}

/* _ServerRoutes.pair_ids(src, dst) (new reference), stored in the shared dict as the method
   stores it: C where the paths meet in the tree, the method where the route goes round */
static PyObject *pair_ids(PyObject *tree, PyObject *shared, PyObject *src, PyObject *dst) {
    PyObject *up, *down, *up_ids = NULL, *down_ids = NULL, *out = NULL;
    Py_ssize_t i, j;
    int meet = tree_meet(tree, src, dst, &up, &down, &i, &j);
    if (meet < 0) return NULL;
    if (meet == 0) return PyObject_CallMethodObjArgs(tree, str_pair_ids, src, dst, NULL);
    if ((up_ids = PyObject_GetAttr(up, str_up)) == NULL || !PyTuple_CheckExact(up_ids)) goto done;
    if (meet == 1) {
        out = up_ids;
        Py_INCREF(out);
    } else {
        if ((down_ids = PyObject_GetAttr(down, str_down)) == NULL) goto done;
        /* up.up[:i] + down.down[j - 1 :: -1] */
        Py_ssize_t nu = i < PyTuple_GET_SIZE(up_ids) ? i : PyTuple_GET_SIZE(up_ids);
        if ((out = PyTuple_New(nu + j)) == NULL) goto done;
        for (Py_ssize_t k = 0; k < nu; k++) {
            PyObject *x = PyTuple_GET_ITEM(up_ids, k);
            Py_INCREF(x);
            PyTuple_SET_ITEM(out, k, x);
        }
        for (Py_ssize_t k = 0; k < j; k++) {
            PyObject *x = PyTuple_GET_ITEM(down_ids, j - 1 - k);
            Py_INCREF(x);
            PyTuple_SET_ITEM(out, nu + k, x);
        }
    }
    if (nested_set(shared, dst, src, untrack_atoms(out)) < 0) Py_CLEAR(out);
done:
    if (out == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "pair_ids: unexpected route types");
    Py_XDECREF(up);
    Py_XDECREF(down);
    Py_XDECREF(up_ids);
    Py_XDECREF(down_ids);
    return out;
}

/* routes.tree_ids(src, dst) (new reference): the shared dict, else computed as pair_ids */
static PyObject *route_ids(PyObject *shared, PyObject *tree, PyObject *src, PyObject *dst) {
    PyObject *got = nested_get(shared, dst, src);
    if (got != NULL) {
        Py_INCREF(got);
        return got;
    }
    if (PyErr_Occurred()) return NULL;
    int same = PyUnicode_Compare(src, dst) == 0;
    if (PyErr_Occurred()) return NULL;
    if (same) {
        Py_INCREF(empty_tuple);
        return empty_tuple;
    }
    got = pair_ids(tree, shared, src, dst);
    if (got != NULL && !PyTuple_CheckExact(got)) {
        Py_DECREF(got);
        PyErr_SetString(PyExc_TypeError, "estimate: a route must be a tuple of link ids");
        return NULL;
    }
    return got;
}

PyObject *py_estimate(PyObject *self, PyObject *args) {
    PyObject *updates, *nodes, *parent, *server, *order, *routes, *shared, *tree = NULL;
    double now;
    if (!PyArg_ParseTuple(args, "O!O!O!OO!OO!d", &PyList_Type, &updates, &PyDict_Type, &nodes, &PyDict_Type,
                          &parent, &server, &PyList_Type, &order, &routes, &PyDict_Type, &shared, &now))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(updates), na = PyDict_GET_SIZE(nodes), total = n + na;
    Py_ssize_t nlinks = 0, nper = 0;
    PyObject *out = NULL, *pos = NULL, *free_s = NULL, *per_s = NULL;
    PyObject **paths = PyMem_Calloc(total ? total : 1, sizeof(PyObject *));
    PyObject **nodeobjs = PyMem_Calloc(na ? na : 1, sizeof(PyObject *)); /* borrowed */
    double *ready = PyMem_Malloc((n ? n : 1) * sizeof(double));
    double *bytes = PyMem_Malloc((n ? n : 1) * sizeof(double));
    Py_ssize_t *to = PyMem_Malloc((total ? total : 1) * sizeof(Py_ssize_t));
    Py_ssize_t *waiting = PyMem_Malloc((na ? na : 1) * sizeof(Py_ssize_t));
    Py_ssize_t *rank = PyMem_Malloc((na ? na : 1) * sizeof(Py_ssize_t));
    double *agg_ready = PyMem_Malloc((na ? na : 1) * sizeof(double));
    HeapEntry *heap = PyMem_Malloc((na ? na : 1) * sizeof(HeapEntry));
    double *busy = NULL, *per = NULL;
    if (!paths || !nodeobjs || !ready || !bytes || !to || !waiting || !rank || !agg_ready || !heap) {
        PyErr_NoMemory();
        goto done;
    }
    if ((pos = places(nodes)) == NULL) goto done;
    if ((tree = PyObject_GetAttr(routes, str_tree)) == NULL) goto done;
    {
        Py_ssize_t it = 0, k = 0;
        PyObject *aid, *node;
        while (PyDict_Next(nodes, &it, &aid, &node)) nodeobjs[k++] = node;
    }
    if (PyList_GET_SIZE(order) != na) {
        PyErr_SetString(PyExc_ValueError, "estimate: order must list every aggregate");
        goto done;
    }
    for (Py_ssize_t r = 0; r < na; r++) {
        PyObject *idx = PyDict_GetItemWithError(pos, PyList_GET_ITEM(order, r));
        if (idx == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "estimate: an ordered id is no aggregate");
            goto done;
        }
        rank[PyLong_AsSsize_t(idx)] = r;
    }
    /* each payload's links (resolved first: link ids are made on first use) and aggregate */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *u = PyList_GET_ITEM(updates, i);
        if (!PyTuple_CheckExact(u) || PyTuple_GET_SIZE(u) != 4) {
            PyErr_SetString(PyExc_TypeError, "estimate: an update must be (ready, bytes, id, source)");
            goto done;
        }
        ready[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(u, 0));
        bytes[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(u, 1));
        if (PyErr_Occurred()) goto done;
        PyObject *a = PyDict_GetItemWithError(parent, PyTuple_GET_ITEM(u, 2));
        PyObject *dst;
        if (a == NULL) {
            if (PyErr_Occurred()) goto done;
            dst = server;
            Py_INCREF(dst);
            to[i] = -1;
        } else {
            PyObject *idx = PyDict_GetItemWithError(pos, a);
            if (idx == NULL) {
                if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, a);
                goto done;
            }
            Py_ssize_t k = PyLong_AsSsize_t(idx);
            to[i] = n + k;
            if ((dst = PyObject_GetAttr(nodeobjs[k], str_aggregator)) == NULL) goto done;
        }
        paths[i] = route_ids(shared, tree, PyTuple_GET_ITEM(u, 3), dst);
        Py_DECREF(dst);
        if (paths[i] == NULL) goto done;
    }
    {
        Py_ssize_t it = 0, k = 0;
        PyObject *aid, *node;
        while (PyDict_Next(nodes, &it, &aid, &node)) {
            PyObject *agg = PyObject_GetAttr(node, str_aggregator);
            if (agg == NULL) goto done;
            PyObject *up = PyObject_GetAttr(node, str_parent);
            if (up == NULL) {
                Py_DECREF(agg);
                goto done;
            }
            PyObject *dst;
            if (up == Py_None) {
                dst = server;
                Py_INCREF(dst);
            } else {
                PyObject *upnode = PyDict_GetItemWithError(nodes, up);
                if (upnode == NULL) {
                    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, up);
                    Py_DECREF(up);
                    Py_DECREF(agg);
                    goto done;
                }
                dst = PyObject_GetAttr(upnode, str_aggregator);
            }
            Py_DECREF(up);
            if (dst == NULL) {
                Py_DECREF(agg);
                goto done;
            }
            paths[n + k] = route_ids(shared, tree, agg, dst);
            Py_DECREF(agg);
            Py_DECREF(dst);
            if (paths[n + k] == NULL) goto done;
            PyObject *a = PyDict_GetItemWithError(parent, aid);
            if (a == NULL) {
                if (PyErr_Occurred()) goto done;
                to[n + k] = -1;
            } else {
                PyObject *idx = PyDict_GetItemWithError(pos, a);
                if (idx == NULL) {
                    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, a);
                    goto done;
                }
                to[n + k] = n + PyLong_AsSsize_t(idx);
            }
            PyObject *members = PyObject_GetAttr(node, str_members);
            if (members == NULL) goto done;
            waiting[k] = PyObject_Length(members);
            Py_DECREF(members);
            if (waiting[k] < 0) goto done;
            k++;
        }
    }
    /* link ids made while resolving: their per-byte and free times (Routes._grow) */
    PyObject *grown = PyObject_CallMethodNoArgs(routes, str_grow);
    if (grown == NULL) goto done;
    Py_DECREF(grown);
    if ((free_s = PyObject_GetAttr(routes, str_free)) == NULL) goto done;
    if ((per_s = PyObject_GetAttr(routes, str_per)) == NULL) goto done;
    if ((busy = floats_of(free_s, &nlinks)) == NULL) goto done;
    if ((per = floats_of(per_s, &nper)) == NULL) goto done;
    if (nper < nlinks) {
        PyErr_SetString(PyExc_ValueError, "estimate: fewer per-byte times than links");
        goto done;
    }
    for (Py_ssize_t a = 0; a < na; a++) agg_ready[a] = -INFINITY;
    Py_ssize_t hn = 0, i = 0;
    double makespan = now;
    while (i < n || hn) {
        HeapEntry e = {0};
        if (hn && (i >= n || heap[0].key < ready[i])) {
            e = heap_pop(heap, &hn);
        } else {
            e.key = ready[i];
            e.tie = bytes[i];
            e.pid = i;
            e.rank = 0;
            i++;
        }
        double end = e.key;
        PyObject *path = paths[e.pid];
        Py_ssize_t len = PyTuple_GET_SIZE(path);
        for (Py_ssize_t k = 0; k < len; k++) {
            Py_ssize_t link = PyLong_AsSsize_t(PyTuple_GET_ITEM(path, k));
            if (link < 0 || link >= nlinks) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "estimate: link id out of range");
                goto done;
            }
            double at = busy[link];
            double done_at = (e.key > at ? e.key : at) + e.tie * per[link];
            busy[link] = done_at;
            if (done_at > end) end = done_at;
        }
        Py_ssize_t dst = to[e.pid];
        if (dst < 0) {
            if (end > makespan) makespan = end;
            continue;
        }
        Py_ssize_t a = dst - n;
        waiting[a] -= 1;
        if (end > agg_ready[a]) agg_ready[a] = end;
        if (waiting[a] == 0) {
            HeapEntry g = {agg_ready[a], e.tie, rank[a], dst, NULL, NULL, NULL}; /* (ready, bytes, id) */
            heap_push(heap, &hn, g);
        }
    }
    out = PyFloat_FromDouble(makespan);
done:
    if (paths != NULL)
        for (Py_ssize_t k = 0; k < total; k++) Py_XDECREF(paths[k]);
    PyMem_Free(paths);
    PyMem_Free(nodeobjs);
    Py_XDECREF(pos);
    Py_XDECREF(tree);
    Py_XDECREF(free_s);
    Py_XDECREF(per_s);
    PyMem_Free(ready);
    PyMem_Free(bytes);
    PyMem_Free(busy);
    PyMem_Free(per);
    PyMem_Free(to);
    PyMem_Free(waiting);
    PyMem_Free(rank);
    PyMem_Free(agg_ready);
    PyMem_Free(heap);
    return out;
}
