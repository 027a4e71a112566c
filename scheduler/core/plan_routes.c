/* mlfabric.scheduler.core._plan_native: the tree routes' per-host loops (tree_routes.py; see _plan_native.c). */
#include "_plan_native.h"

static PyObject *str_capacity_r; /* "capacity" */
PyObject *dst_of(PyObject *path, PyObject *adj, PyObject *lid, PyObject *links, PyObject *cls);

/* An instance of the __slots__ class `cls` (tree_routes._Host) whose __init__ only sets
   path and up, those set here (new reference). */
static PyObject *host_of(PyObject *cls, PyObject *path, PyObject *up) {
    PyObject *obj = ((PyTypeObject *)cls)->tp_alloc((PyTypeObject *)cls, 0);
    if (obj == NULL) return NULL;
    if (PyObject_SetAttr(obj, str_path, path) < 0 || PyObject_SetAttr(obj, str_up, up) < 0) {
        Py_DECREF(obj);
        return NULL;
    }
    return obj;
}

/* tree_routes._LinkIds()(link): the link's id in `lid`, made on first use (appended to `links`);
   new reference, NULL on error */
static PyObject *link_id(PyObject *lid, PyObject *links, PyObject *link) {
    PyObject *i = PyDict_GetItemWithError(lid, link);
    if (i != NULL) {
        Py_INCREF(i);
    } else if (!PyErr_Occurred()) {
        i = PyLong_FromSsize_t(PyList_GET_SIZE(links));
        if (i != NULL && (PyDict_SetItem(lid, link, i) < 0 || PyList_Append(links, link) < 0)) Py_CLEAR(i);
    }
    return i;
}

/* (head, *tail) as a new tuple */
static PyObject *cons(PyObject *head, PyObject *tail) {
    Py_ssize_t n = PyTuple_GET_SIZE(tail);
    PyObject *out = PyTuple_New(n + 1);
    if (out == NULL) return NULL;
    Py_INCREF(head);
    PyTuple_SET_ITEM(out, 0, head);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *x = PyTuple_GET_ITEM(tail, k);
        Py_INCREF(x);
        PyTuple_SET_ITEM(out, k + 1, x);
    }
    return out;
}

/* tree_hosts(next_hops, hosts, lid, links, Host): _ServerRoutes._every's loop. */
PyObject *py_tree_hosts(PyObject *self, PyObject *args) {
    PyObject *next_hops, *hosts, *lid, *links, *cls;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!", &PyDict_Type, &next_hops, &PyDict_Type, &hosts, &PyDict_Type, &lid,
                          &PyList_Type, &links, &PyType_Type, &cls))
        return NULL;
    Py_ssize_t it = 0;
    PyObject *v, *nxt;
    while (PyDict_Next(next_hops, &it, &v, &nxt)) {
        int known = PyDict_Contains(hosts, v);
        if (known < 0) return NULL;
        if (known) continue;
        int same = PyObject_RichCompareBool(v, nxt, Py_EQ);
        if (same < 0) return NULL;
        PyObject *host;
        if (same) { /* the server */
            PyObject *path = PyTuple_Pack(1, v);
            if (path == NULL) return NULL;
            host = host_of(cls, path, empty_tuple);
            Py_DECREF(path);
        } else {
            PyObject *on = PyDict_GetItemWithError(hosts, nxt); /* listed before v */
            if (on == NULL) {
                if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, nxt);
                return NULL;
            }
            Py_INCREF(on);
            PyObject *link = untrack_atoms(PyTuple_Pack(2, v, nxt));
            PyObject *on_path = link ? PyObject_GetAttr(on, str_path) : NULL;
            PyObject *on_up = on_path ? PyObject_GetAttr(on, str_up) : NULL;
            Py_DECREF(on);
            if (on_up == NULL || !PyTuple_CheckExact(on_path) || !PyTuple_CheckExact(on_up)) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "tree_hosts: paths must be tuples");
                Py_XDECREF(link);
                Py_XDECREF(on_path);
                Py_XDECREF(on_up);
                return NULL;
            }
            PyObject *i = link_id(lid, links, link);
            Py_DECREF(link);
            PyObject *path = i ? untrack_atoms(cons(v, on_path)) : NULL;
            PyObject *up = path ? untrack_atoms(cons(i, on_up)) : NULL;
            host = up ? host_of(cls, path, up) : NULL;
            Py_XDECREF(i);
            Py_XDECREF(path);
            Py_XDECREF(up);
            Py_DECREF(on_path);
            Py_DECREF(on_up);
        }
        if (host == NULL) return NULL;
        int rc = PyDict_SetItem(hosts, v, host);
        Py_DECREF(host);
        if (rc < 0) return NULL;
    }
    Py_RETURN_NONE;
}

/* 1 where a node of `path` is in the set `crossed` (crossed.intersection(path)), 0, -1 */
static int crosses(PyObject *crossed, PyObject *path) {
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(path); k++) {
        int in = PySet_Contains(crossed, PyTuple_GET_ITEM(path, k));
        if (in != 0) return in;
    }
    return 0;
}

/* paths[h][1:-1]: below[x].append(h) for each node x */
static int add_below(PyObject *below, PyObject *path, PyObject *h) {
    for (Py_ssize_t k = 1; k < PyTuple_GET_SIZE(path) - 1; k++) {
        PyObject *x = PyTuple_GET_ITEM(path, k);
        PyObject *hs = PyDict_GetItemWithError(below, x);
        if (hs == NULL) {
            if (PyErr_Occurred()) return -1;
            hs = PyList_New(0);
            if (hs == NULL) return -1;
            int rc = PyDict_SetItem(below, x, hs);
            Py_DECREF(hs);
            if (rc < 0) return -1;
        }
        if (PyList_Append(hs, h) < 0) return -1;
    }
    return 0;
}

/* hosts[h].path, else tree.host(h).path (new reference; NULL on error, a ValueError among them
   where h has no path) */
static PyObject *path_of(PyObject *tree, PyObject *hosts, PyObject *h) {
    PyObject *on = PyDict_GetItemWithError(hosts, h);
    if (on != NULL) {
        Py_INCREF(on);
    } else {
        if (PyErr_Occurred()) return NULL;
        if ((on = PyObject_CallMethodOneArg(tree, str_host, h)) == NULL) return NULL;
    }
    PyObject *path = PyObject_GetAttr(on, str_path);
    Py_DECREF(on);
    if (path != NULL && !PyTuple_CheckExact(path)) {
        Py_DECREF(path);
        PyErr_SetString(PyExc_TypeError, "tree_shape: a path must be a tuple");
        return NULL;
    }
    return path;
}

/* tree_shape(tree, hosts, server_host, eligible, sources, every) -> (paths, below): RouteCache._shape's loops */
PyObject *py_tree_shape(PyObject *self, PyObject *args) {
    PyObject *tree, *hosts, *server, *eligible, *sources, *every;
    if (!PyArg_ParseTuple(args, "OO!OO!O!O!", &tree, &PyDict_Type, &hosts, &server, &PyFrozenSet_Type, &eligible,
                          &PyFrozenSet_Type, &sources, &PyList_Type, &every))
        return NULL;
    PyObject *paths = PyDict_New(), *below = PyDict_New(), *crossed = PySet_New(NULL), *iter = NULL, *s;
    if (paths == NULL || below == NULL || crossed == NULL) goto fail;
    if ((iter = PyObject_GetIter(sources)) == NULL) goto fail;
    while ((s = PyIter_Next(iter)) != NULL) { /* paths = {s: tree.host(s).path for s in sources} */
        PyObject *path = path_of(tree, hosts, s);
        int rc = path ? PyDict_SetItem(paths, s, path) : -1;
        Py_DECREF(s);
        Py_XDECREF(path);
        if (rc < 0) goto fail;
    }
    Py_CLEAR(iter);
    if (PyErr_Occurred()) goto fail;
    {
        Py_ssize_t it = 0;
        PyObject *key, *path;
        while (PyDict_Next(paths, &it, &key, &path))
            for (Py_ssize_t k = 1; k < PyTuple_GET_SIZE(path) - 1; k++)
                if (PySet_Add(crossed, PyTuple_GET_ITEM(path, k)) < 0) goto fail;
    }
    for (Py_ssize_t n = 0; n < PyList_GET_SIZE(every); n++) {
        PyObject *h = PyList_GET_ITEM(every, n);
        int ok = PySet_Contains(eligible, h);
        if (ok < 0) goto fail;
        if (!ok) continue;
        int is_server = PyObject_RichCompareBool(h, server, Py_EQ);
        if (is_server < 0) goto fail;
        if (is_server) continue;
        PyObject *path = PyDict_GetItemWithError(paths, h);
        if (path != NULL) {
            Py_INCREF(path);
        } else {
            if (PyErr_Occurred()) goto fail;
            if ((path = path_of(tree, hosts, h)) == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_ValueError)) goto fail;
                PyErr_Clear(); /* no path to the server */
                continue;
            }
            int cross = crosses(crossed, path);
            if (cross <= 0 || PyDict_SetItem(paths, h, path) < 0) {
                Py_DECREF(path);
                if (cross == 0) continue;
                goto fail;
            }
        }
        int rc = add_below(below, path, h);
        Py_DECREF(path);
        if (rc < 0) goto fail;
    }
    Py_DECREF(crossed);
    return Py_BuildValue("(NN)", paths, below);
fail:
    Py_XDECREF(iter);
    Py_XDECREF(paths);
    Py_XDECREF(below);
    Py_XDECREF(crossed);
    return NULL;
}

/* tree_bottlenecks(adj, next_hops, server) -> {node: lowest capacity on its path to the
   server}: RouteCache.bottlenecks' loop (every node after its next hop; the server inf). */
PyObject *py_tree_bottlenecks(PyObject *self, PyObject *args) {
    PyObject *adj, *next_hops, *server;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyDict_Type, &adj, &PyDict_Type, &next_hops, &server)) return NULL;
    if (str_capacity_r == NULL && (str_capacity_r = PyUnicode_InternFromString("capacity")) == NULL) return NULL;
    PyObject *known = PyDict_New(), *inf = PyFloat_FromDouble(INFINITY);
    if (known == NULL || inf == NULL || PyDict_SetItem(known, server, inf) < 0) goto fail;
    Py_ssize_t it = 0;
    PyObject *v, *nxt;
    while (PyDict_Next(next_hops, &it, &v, &nxt)) {
        int same = PyObject_RichCompareBool(v, nxt, Py_EQ);
        if (same < 0) goto fail;
        if (same) continue;
        PyObject *out = PyDict_GetItemWithError(adj, v), *attrs = NULL, *c = NULL;
        if (out != NULL) attrs = PyObject_GetItem(out, nxt);
        if (attrs != NULL) {
            c = PyObject_GetItem(attrs, str_capacity_r);
            Py_DECREF(attrs);
        }
        if (c == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, v);
            goto fail;
        }
        double cap = PyFloat_AsDouble(c); /* float(capacity) */
        Py_DECREF(c);
        if (cap == -1.0 && PyErr_Occurred()) goto fail;
        PyObject *rate = PyDict_GetItemWithError(known, nxt);
        if (rate == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, nxt);
            goto fail;
        }
        PyObject *got;
        if (cap < PyFloat_AsDouble(rate)) { /* cap if cap < rate else rate */
            if ((got = PyFloat_FromDouble(cap)) == NULL) goto fail;
        } else {
            got = rate;
            Py_INCREF(got);
        }
        int rc = PyDict_SetItem(known, v, got);
        Py_DECREF(got);
        if (rc < 0) goto fail;
    }
    Py_DECREF(inf);
    return known;
fail:
    Py_XDECREF(known);
    Py_XDECREF(inf);
    return NULL;
}

/* tree_dst(path, adj, lid, links, Dst) -> a _Dst of `path` (its slots pos, down and back set
   without its __init__, which only sets them): _ServerRoutes._dst, the links back down the path
   for as long as the graph `adj` (node -> its links out) has them, their ids made on first use. */
PyObject *py_tree_dst(PyObject *self, PyObject *args) {
    PyObject *path, *adj, *lid, *links, *cls;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!", &PyTuple_Type, &path, &PyDict_Type, &adj, &PyDict_Type, &lid,
                          &PyList_Type, &links, &PyType_Type, &cls))
        return NULL;
    return dst_of(path, adj, lid, links, cls);
}

static PyObject *str_adj_r, *str_link_id_r, *str_lid_r, *str_links_r, *str_dst_type_r;

/* tree._dst(h) (new reference), made here where the tree's slots hold what tree_dst takes (its
   graph's links out made, h's path known): the method else. */
PyObject *tree_dst_of(PyObject *tree, PyObject *hosts, PyObject *dsts, PyObject *h) {
    if (str_adj_r == NULL &&
        ((str_adj_r = PyUnicode_InternFromString("adj")) == NULL ||
         (str_link_id_r = PyUnicode_InternFromString("link_id")) == NULL ||
         (str_lid_r = PyUnicode_InternFromString("lid")) == NULL ||
         (str_links_r = PyUnicode_InternFromString("links")) == NULL ||
         (str_dst_type_r = PyUnicode_InternFromString("dst_type")) == NULL))
        return NULL;
    PyObject *on = PyDict_GetItemWithError(hosts, h);
    if (on == NULL) {
        if (PyErr_Occurred()) return NULL;
        return PyObject_CallMethodOneArg(tree, str_dst_m, h);
    }
    PyObject *adj = PyObject_GetAttr(tree, str_adj_r), *link_id = NULL, *lid = NULL, *links = NULL, *cls = NULL;
    PyObject *path = NULL, *out = NULL;
    if (adj == NULL) return NULL;
    if (!PyDict_CheckExact(adj)) { /* not made yet: the method makes it */
        Py_DECREF(adj);
        return PyObject_CallMethodOneArg(tree, str_dst_m, h);
    }
    if ((link_id = PyObject_GetAttr(tree, str_link_id_r)) == NULL) goto done;
    if ((lid = PyObject_GetAttr(link_id, str_lid_r)) == NULL) goto done;
    if ((links = PyObject_GetAttr(link_id, str_links_r)) == NULL) goto done;
    if ((cls = PyObject_GetAttr(tree, str_dst_type_r)) == NULL) goto done;
    if ((path = PyObject_GetAttr(on, str_path)) == NULL) goto done;
    if (!PyTuple_CheckExact(path) || !PyDict_CheckExact(lid) || !PyList_CheckExact(links) || !PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "tree_dst_of: unexpected route types");
        goto done;
    }
    out = dst_of(path, adj, lid, links, cls);
    if (out != NULL && PyDict_SetItem(dsts, h, out) < 0) Py_CLEAR(out);
done:
    Py_XDECREF(adj);
    Py_XDECREF(link_id);
    Py_XDECREF(lid);
    Py_XDECREF(links);
    Py_XDECREF(cls);
    Py_XDECREF(path);
    return out;
}

/* tree_dst's _Dst of `path` (new reference) */
PyObject *dst_of(PyObject *path, PyObject *adj, PyObject *lid, PyObject *links, PyObject *cls) {
    Py_ssize_t n = PyTuple_GET_SIZE(path);
    PyObject *pos = PyDict_New(), *down = PyList_New(0), *back = PyTuple_New(n), *down_t = NULL, *obj = NULL;
    if (pos == NULL || down == NULL || back == NULL) goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *x = PyTuple_GET_ITEM(path, k);
        PyObject *i = PyLong_FromSsize_t(k);
        int rc = i ? PyDict_SetItem(pos, x, i) : -1;
        Py_XDECREF(i);
        if (rc < 0) goto done;
        Py_INCREF(x);
        PyTuple_SET_ITEM(back, n - 1 - k, x);
    }
    for (Py_ssize_t k = 0; k + 1 < n; k++) {
        PyObject *a = PyTuple_GET_ITEM(path, k), *b = PyTuple_GET_ITEM(path, k + 1);
        PyObject *out = PyDict_GetItemWithError(adj, b); /* graph.has_edge(b, a) */
        if (out == NULL) {
            if (PyErr_Occurred()) goto done;
            break;
        }
        int has = PyDict_Check(out) ? PyDict_Contains(out, a) : PySequence_Contains(out, a);
        if (has < 0) goto done;
        if (!has) break;
        PyObject *link = untrack_atoms(PyTuple_Pack(2, b, a));
        if (link == NULL) goto done;
        PyObject *i = link_id(lid, links, link);
        Py_DECREF(link);
        int rc = i ? PyList_Append(down, i) : -1;
        Py_XDECREF(i);
        if (rc < 0) goto done;
    }
    if ((down_t = untrack_atoms(PyList_AsTuple(down))) == NULL) goto done;
    untrack_atoms(back);
    if ((obj = ((PyTypeObject *)cls)->tp_alloc((PyTypeObject *)cls, 0)) == NULL) goto done;
    if (PyObject_SetAttr(obj, str_pos, pos) < 0 || PyObject_SetAttr(obj, str_down, down_t) < 0 ||
        PyObject_SetAttr(obj, str_back, back) < 0)
        Py_CLEAR(obj);
done:
    Py_XDECREF(pos);
    Py_XDECREF(down);
    Py_XDECREF(back);
    Py_XDECREF(down_t);
    return obj;
}
