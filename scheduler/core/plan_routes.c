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
            PyObject *i = PyDict_GetItemWithError(lid, link); /* the link's id, made on first use */
            if (i != NULL) {
                Py_INCREF(i);
            } else if (!PyErr_Occurred()) {
                i = PyLong_FromSsize_t(PyList_GET_SIZE(links));
                if (i != NULL && (PyDict_SetItem(lid, link, i) < 0 || PyList_Append(links, link) < 0)) Py_CLEAR(i);
            }
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
        PyObject *i = PyDict_GetItemWithError(lid, link); /* link_id(link) */
        if (i != NULL) {
            Py_INCREF(i);
        } else if (!PyErr_Occurred()) {
            i = PyLong_FromSsize_t(PyList_GET_SIZE(links));
            if (i != NULL && (PyDict_SetItem(lid, link, i) < 0 || PyList_Append(links, link) < 0)) Py_CLEAR(i);
        }
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

/* decision_sends(transfers, after, ids, planned, Send, fields) -> (sends, carried) | None:
   schedule_to_decision's loop over the transfers: each transfer of a payload that is not an
   aggregate of the plan becomes a Send (its id renamed by `ids`; made as make_instance makes
   it), each of an aggregate is carried (payload id -> (transfer, its after)). None, with
   nothing made, where a transfer is a replica's: the Python loop runs. */
static PyObject *str_replica_r, *str_dst_r;

PyObject *py_decision_sends(PyObject *self, PyObject *args) {
    PyObject *transfers, *after, *ids, *planned, *cls, *fields;
    if (!PyArg_ParseTuple(args, "O!O!O!O!OO", &PyTuple_Type, &transfers, &PyList_Type, &after, &PyDict_Type, &ids,
                          &PySet_Type, &planned, &cls, &fields))
        return NULL;
    if (str_replica_r == NULL && ((str_replica_r = PyUnicode_InternFromString("replica")) == NULL ||
                                  (str_dst_r = PyUnicode_InternFromString("dst")) == NULL))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(transfers);
    if (PyList_GET_SIZE(after) != n) {
        PyErr_SetString(PyExc_ValueError, "decision_sends: one after per transfer");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* a replica's transfer: the Python loop */
        PyObject *r = PyObject_GetAttr(PyTuple_GET_ITEM(transfers, i), str_replica_r);
        if (r == NULL) return NULL;
        int truthy = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (truthy < 0) return NULL;
        if (truthy) Py_RETURN_NONE;
    }
    PyObject *sends = PyList_New(0), *carried = PyDict_New();
    if (sends == NULL || carried == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyTuple_GET_ITEM(transfers, i), *a = PyList_GET_ITEM(after, i);
        PyObject *pid = PyObject_GetAttr(t, str_payload_id);
        if (pid == NULL) goto fail;
        int agg = PySet_Contains(planned, pid);
        if (agg) {
            PyObject *pair = agg > 0 ? PyTuple_Pack(2, t, a) : NULL;
            int rc = pair ? PyDict_SetItem(carried, pid, pair) : -1;
            Py_XDECREF(pair);
            Py_DECREF(pid);
            if (rc < 0) goto fail;
            continue;
        }
        PyObject *renamed = PyDict_GetItemWithError(ids, pid); /* ids.get(pid, pid) */
        if (renamed == NULL && PyErr_Occurred()) {
            Py_DECREF(pid);
            goto fail;
        }
        PyObject *vals[6] = {renamed ? renamed : pid, NULL, NULL, a, NULL, NULL};
        vals[1] = PyObject_GetAttr(t, str_dst_r);
        vals[2] = vals[1] ? PyObject_GetAttr(t, str_path) : NULL;
        vals[4] = vals[2] ? PyObject_GetAttr(t, str_start) : NULL;
        vals[5] = vals[4] ? PyObject_GetAttr(t, str_end) : NULL;
        PyObject *send = vals[5] ? make_instance(cls, fields, vals, 6) : NULL;
        Py_DECREF(pid);
        Py_XDECREF(vals[1]);
        Py_XDECREF(vals[2]);
        Py_XDECREF(vals[4]);
        Py_XDECREF(vals[5]);
        int rc = send ? PyList_Append(sends, send) : -1;
        Py_XDECREF(send);
        if (rc < 0) goto fail;
    }
    return Py_BuildValue("(NN)", sends, carried);
fail:
    Py_XDECREF(sends);
    Py_XDECREF(carried);
    return NULL;
}

/* tree_tables(order, paths, adj, eligible, below) -> (top, groups, depth, index, host_of):
   trees._tree's loops. ingress: each eligible host of `paths` -> the fastest link into it
   (one pass over the graph's links `adj`; 0 where none); top: node -> (its hosts `below`
   with the fastest ingress, the same as a set); groups: the nodes between a source and the
   server -> the ids of its updates (in `order`); depth: such a node -> nodes from it to the
   server; index: update id -> place in `order`; host_of: update id -> source. */
PyObject *py_tree_tables(PyObject *self, PyObject *args) {
    PyObject *order, *paths, *adj, *eligible, *below;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!", &PyList_Type, &order, &PyDict_Type, &paths, &PyDict_Type, &adj,
                          &PyFrozenSet_Type, &eligible, &PyDict_Type, &below))
        return NULL;
    if (str_capacity_r == NULL && (str_capacity_r = PyUnicode_InternFromString("capacity")) == NULL) return NULL;
    PyObject *ingress = PyDict_New(), *top = PyDict_New(), *groups = PyDict_New(), *depth = PyDict_New();
    PyObject *index = PyDict_New(), *host_of = PyDict_New();
    double *caps = NULL;
    if (!ingress || !top || !groups || !depth || !index || !host_of) goto fail;
    Py_ssize_t it = 0;
    PyObject *v, *nbrs;
    while (PyDict_Next(adj, &it, &v, &nbrs)) {
        if (!PyDict_Check(nbrs)) {
            PyErr_SetString(PyExc_TypeError, "tree_tables: links out must be a dict");
            goto fail;
        }
        Py_ssize_t jt = 0;
        PyObject *h, *d;
        while (PyDict_Next(nbrs, &jt, &h, &d)) {
            int in = PyDict_Contains(paths, h);
            if (in > 0) in = PySet_Contains(eligible, h);
            if (in < 0) goto fail;
            if (!in) continue;
            PyObject *c_o = PyObject_GetItem(d, str_capacity_r);
            if (c_o == NULL) goto fail;
            double c = PyFloat_AsDouble(c_o); /* float(d["capacity"]) */
            Py_DECREF(c_o);
            if (c == -1.0 && PyErr_Occurred()) goto fail;
            PyObject *got = PyDict_GetItemWithError(ingress, h);
            if (got == NULL && PyErr_Occurred()) goto fail;
            if (got == NULL || c > PyFloat_AS_DOUBLE(got)) { /* max() */
                PyObject *f = PyFloat_FromDouble(c);
                int rc = f ? PyDict_SetItem(ingress, h, f) : -1;
                Py_XDECREF(f);
                if (rc < 0) goto fail;
            }
        }
    }
    it = 0;
    PyObject *x, *hs;
    while (PyDict_Next(below, &it, &x, &hs)) {
        if (!PyList_CheckExact(hs) || PyList_GET_SIZE(hs) == 0) {
            PyErr_SetString(PyExc_TypeError, "tree_tables: below must list hosts");
            goto fail;
        }
        Py_ssize_t n = PyList_GET_SIZE(hs);
        PyMem_Free(caps);
        if ((caps = PyMem_Malloc(n * sizeof(double))) == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t k = 0; k < n; k++) {
            PyObject *got = PyDict_GetItemWithError(ingress, PyList_GET_ITEM(hs, k));
            if (got == NULL && PyErr_Occurred()) goto fail;
            caps[k] = got ? PyFloat_AS_DOUBLE(got) : 0.0; /* 0: no link in */
        }
        double fastest = caps[0];
        for (Py_ssize_t k = 1; k < n; k++)
            if (caps[k] > fastest) fastest = caps[k];
        PyObject *tier = PyList_New(0);
        if (tier == NULL) goto fail;
        for (Py_ssize_t k = 0; k < n; k++)
            if (caps[k] == fastest && PyList_Append(tier, PyList_GET_ITEM(hs, k)) < 0) {
                Py_DECREF(tier);
                goto fail;
            }
        PyObject *set = PySet_New(tier);
        PyObject *pair = set ? PyTuple_Pack(2, tier, set) : NULL;
        Py_DECREF(tier);
        Py_XDECREF(set);
        int rc = pair ? PyDict_SetItem(top, x, pair) : -1;
        Py_XDECREF(pair);
        if (rc < 0) goto fail;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(order); i++) {
        PyObject *u = PyList_GET_ITEM(order, i);
        PyObject *uid = PyObject_GetAttr(u, str_update_id);
        PyObject *src = uid ? PyObject_GetAttr(u, str_src) : NULL;
        PyObject *path = src ? PyDict_GetItemWithError(paths, src) : NULL;
        PyObject *on = NULL, *idx = NULL, *uids;
        int rc = -1;
        if (path == NULL) {
            if (src != NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, src);
            goto next;
        }
        if (!PyTuple_CheckExact(path) || PyTuple_GET_SIZE(path) < 2) {
            PyErr_SetString(PyExc_TypeError, "tree_tables: a path must be a tuple of two nodes or more");
            goto next;
        }
        if ((on = untrack_atoms(PyTuple_GetSlice(path, 1, PyTuple_GET_SIZE(path) - 1))) == NULL) goto next;
        uids = PyDict_GetItemWithError(groups, on);
        if (uids == NULL) {
            if (PyErr_Occurred() || (uids = PyList_New(0)) == NULL) goto next;
            int set = PyDict_SetItem(groups, on, uids);
            Py_DECREF(uids);
            if (set < 0) goto next;
        }
        if (PyList_Append(uids, uid) < 0) goto next;
        if ((idx = PyLong_FromSsize_t(i)) == NULL) goto next;
        if (PyDict_SetItem(index, uid, idx) < 0 || PyDict_SetItem(host_of, uid, src) < 0) goto next;
        rc = 0;
    next:
        Py_XDECREF(uid);
        Py_XDECREF(src);
        Py_XDECREF(on);
        Py_XDECREF(idx);
        if (rc < 0) goto fail;
    }
    it = 0;
    PyObject *on, *uids;
    while (PyDict_Next(groups, &it, &on, &uids)) {
        Py_ssize_t n = PyTuple_GET_SIZE(on);
        for (Py_ssize_t i = 0; i < n; i++) { /* len(on) + 1 - i */
            PyObject *dv = PyLong_FromSsize_t(n + 1 - i);
            int rc = dv ? PyDict_SetItem(depth, PyTuple_GET_ITEM(on, i), dv) : -1;
            Py_XDECREF(dv);
            if (rc < 0) goto fail;
        }
    }
    PyMem_Free(caps);
    Py_DECREF(ingress);
    return Py_BuildValue("(NNNNN)", top, groups, depth, index, host_of);
fail:
    PyMem_Free(caps);
    Py_XDECREF(ingress);
    Py_XDECREF(top);
    Py_XDECREF(groups);
    Py_XDECREF(depth);
    Py_XDECREF(index);
    Py_XDECREF(host_of);
    return NULL;
}

/* update_rows(order, now) -> (rows, readies, sizes): for each Update of `order`, (max(ready_at,
   now), bytes, update_id, src) (trees._plan_server's estimate input), max(ready_at, now)
   (tree_cost.reserve's) and update_id -> bytes (reserve's sizes); max() as Python's: `now`
   only where it is greater, else the update's own ready_at object. */
static PyObject *str_ready_at_r, *str_bytes_r;

PyObject *py_update_rows(PyObject *self, PyObject *args) {
    PyObject *order, *now;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &order, &now)) return NULL;
    if (str_ready_at_r == NULL && ((str_ready_at_r = PyUnicode_InternFromString("ready_at")) == NULL ||
                                   (str_bytes_r = PyUnicode_InternFromString("bytes")) == NULL))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(order);
    PyObject *rows = PyList_New(n), *readies = PyList_New(n), *sizes = PyDict_New();
    if (rows == NULL || readies == NULL || sizes == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *u = PyList_GET_ITEM(order, i);
        PyObject *ready = PyObject_GetAttr(u, str_ready_at_r), *nbytes = NULL, *uid = NULL, *src = NULL;
        int later = ready ? PyObject_RichCompareBool(now, ready, Py_GT) : -1;
        PyObject *start = later > 0 ? now : ready;
        if (later >= 0) nbytes = PyObject_GetAttr(u, str_bytes_r);
        if (nbytes) uid = PyObject_GetAttr(u, str_update_id);
        if (uid) src = PyObject_GetAttr(u, str_src);
        PyObject *row = src ? PyTuple_Pack(4, start, nbytes, uid, src) : NULL;
        int rc = row ? PyDict_SetItem(sizes, uid, nbytes) : -1;
        if (rc == 0) {
            PyList_SET_ITEM(rows, i, row);
            Py_INCREF(start);
            PyList_SET_ITEM(readies, i, start);
        } else {
            Py_XDECREF(row);
        }
        Py_XDECREF(ready);
        Py_XDECREF(nbytes);
        Py_XDECREF(uid);
        Py_XDECREF(src);
        if (rc < 0) goto fail;
    }
    return Py_BuildValue("(NNN)", rows, readies, sizes);
fail:
    Py_XDECREF(rows);
    Py_XDECREF(readies);
    Py_XDECREF(sizes);
    return NULL;
}

/* per_byte(adj, links) -> [1.0 / float(adj[a][b]["capacity"]) for a, b in links] (tree_routes.Routes._grow) */
PyObject *py_per_byte(PyObject *self, PyObject *args) {
    PyObject *adj, *links;
    if (!PyArg_ParseTuple(args, "O!O!", &PyDict_Type, &adj, &PyList_Type, &links)) return NULL;
    if (str_capacity_r == NULL && (str_capacity_r = PyUnicode_InternFromString("capacity")) == NULL) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(links);
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *link = PyList_GET_ITEM(links, i);
        if (!PyTuple_CheckExact(link) || PyTuple_GET_SIZE(link) != 2) {
            PyErr_SetString(PyExc_TypeError, "per_byte: a link must be a pair of nodes");
            goto fail;
        }
        PyObject *nbrs = PyObject_GetItem(adj, PyTuple_GET_ITEM(link, 0));
        PyObject *d = nbrs ? PyObject_GetItem(nbrs, PyTuple_GET_ITEM(link, 1)) : NULL;
        PyObject *c = d ? PyObject_GetItem(d, str_capacity_r) : NULL;
        Py_XDECREF(nbrs);
        Py_XDECREF(d);
        if (c == NULL) goto fail;
        double cap = PyFloat_AsDouble(c);
        Py_DECREF(c);
        if (cap == -1.0 && PyErr_Occurred()) goto fail;
        if (cap == 0.0) {
            PyErr_SetString(PyExc_ZeroDivisionError, "float division by zero");
            goto fail;
        }
        PyObject *f = PyFloat_FromDouble(1.0 / cap);
        if (f == NULL) goto fail;
        PyList_SET_ITEM(out, i, f);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}
