/* mlfabric.scheduler.core._plan_native: the tree planner's per-update rows and tables (trees.py,
   tree_cost.py, tree_routes.Routes, convert.schedule_to_decision; see _plan_native.c). */
#include "_plan_native.h"

static PyObject *str_capacity_t; /* "capacity" */

/* decision_sends(transfers, after, ids, planned, Send, fields[, rows]) -> (sends, carried) | None:
   schedule_to_decision's loop over the transfers: each transfer of a payload that is not an
   aggregate of the plan becomes a Send (its id renamed by `ids`; made as make_instance makes
   it, untracked by the cyclic collector where its fields are leaves: untrack_record), each of
   an aggregate is carried (payload id -> (transfer, its after)). None, with
   nothing made, where a transfer is a replica's: the Python loop runs. A transfer of class
   `rows` (schedule.TransferTimes) is read by place. */
static PyObject *str_replica_r, *str_dst_r;

PyObject *py_decision_sends(PyObject *self, PyObject *args) {
    PyObject *transfers, *after, *ids, *planned, *cls, *fields, *rows = NULL;
    if (!PyArg_ParseTuple(args, "O!O!O!O!OO|O!", &PyTuple_Type, &transfers, &PyList_Type, &after, &PyDict_Type, &ids,
                          &PySet_Type, &planned, &cls, &fields, &PyType_Type, &rows))
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
        PyObject *t = PyTuple_GET_ITEM(transfers, i);
        if (rows != NULL && Py_TYPE(t) == (PyTypeObject *)rows && PyTuple_GET_SIZE(t) == 8) {
            if (PyTuple_GET_ITEM(t, 7) == Py_False) continue; /* a TransferTimes row's replica */
        }
        PyObject *r = PyObject_GetAttr(t, str_replica_r);
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
        int row = rows != NULL && Py_TYPE(t) == (PyTypeObject *)rows && PyTuple_GET_SIZE(t) == 8;
        PyObject *pid = row ? Py_NewRef(PyTuple_GET_ITEM(t, 0)) : PyObject_GetAttr(t, str_payload_id);
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
        if (row) { /* a TransferTimes row: its fields by place */
            vals[1] = Py_NewRef(PyTuple_GET_ITEM(t, 2));
            vals[2] = Py_NewRef(PyTuple_GET_ITEM(t, 3));
            vals[4] = Py_NewRef(PyTuple_GET_ITEM(t, 4));
            vals[5] = Py_NewRef(PyTuple_GET_ITEM(t, 5));
        } else {
            vals[1] = PyObject_GetAttr(t, str_dst_r);
            vals[2] = vals[1] ? PyObject_GetAttr(t, str_path) : NULL;
            vals[4] = vals[2] ? PyObject_GetAttr(t, str_start) : NULL;
            vals[5] = vals[4] ? PyObject_GetAttr(t, str_end) : NULL;
        }
        PyObject *send = vals[5] ? untrack_record(make_instance(cls, fields, vals, 6)) : NULL;
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
    if (str_capacity_t == NULL && (str_capacity_t = PyUnicode_InternFromString("capacity")) == NULL) return NULL;
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
            PyObject *c_o = PyObject_GetItem(d, str_capacity_t);
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
    if (str_capacity_t == NULL && (str_capacity_t = PyUnicode_InternFromString("capacity")) == NULL) return NULL;
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
        PyObject *c = d ? PyObject_GetItem(d, str_capacity_t) : NULL;
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

/* dispatch_index(sends) -> (planned, pos, held, waiting, free) | None: dispatch.Dispatcher.adopt's
   loops. planned: update id -> send (the last of an id, at its first place), pos: id -> place,
   held: id -> how many of its `after` are planned (counted as listed), waiting: id -> the id, or
   the list of ids, of the planned sends whose `after` names it, free: the planned ids none of
   whose `after` is planned. None, with nothing kept, where an update id is not a str or an
   `after` is not a tuple: the Python loop runs. */
static PyObject *str_after_d;

static int index_one(PyObject *planned, PyObject *uid, PyObject *after, PyObject *held, PyObject *waiting,
                     PyObject *free) {
    Py_ssize_t n = 0;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(after); k++) {
        PyObject *a = PyTuple_GET_ITEM(after, k);
        int in = PyDict_Contains(planned, a);
        if (in < 0) return -1;
        if (!in) continue;
        n++;
        PyObject *w = PyDict_GetItemWithError(waiting, a);
        int rc;
        if (w == NULL) {
            rc = PyErr_Occurred() ? -1 : PyDict_SetItem(waiting, a, uid);
        } else if (PyUnicode_Check(w)) {
            PyObject *pair = PyList_New(2);
            if (pair == NULL) return -1;
            PyList_SET_ITEM(pair, 0, Py_NewRef(w));
            PyList_SET_ITEM(pair, 1, Py_NewRef(uid));
            rc = PyDict_SetItem(waiting, a, pair);
            Py_DECREF(pair);
        } else {
            rc = PyList_Append(w, uid);
        }
        if (rc < 0) return -1;
    }
    if (n == 0) return PySet_Add(free, uid);
    PyObject *v = PyLong_FromSsize_t(n);
    int rc = v == NULL ? -1 : PyDict_SetItem(held, uid, v);
    Py_XDECREF(v);
    return rc;
}

PyObject *py_dispatch_index(PyObject *self, PyObject *args) {
    PyObject *sends;
    if (!PyArg_ParseTuple(args, "O!", &PyTuple_Type, &sends)) return NULL;
    if (str_after_d == NULL && (str_after_d = PyUnicode_InternFromString("after")) == NULL) return NULL;
    PyObject *planned = PyDict_New(), *pos = PyDict_New(), *held = PyDict_New(), *waiting = PyDict_New();
    PyObject *free = PySet_New(NULL), *out = NULL;
    if (!planned || !pos || !held || !waiting || !free) goto done;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(sends); i++) {
        PyObject *uid = PyObject_GetAttr(PyTuple_GET_ITEM(sends, i), str_update_id);
        if (uid == NULL) goto done;
        int rc = PyUnicode_CheckExact(uid) ? PyDict_SetItem(planned, uid, PyTuple_GET_ITEM(sends, i)) : 1;
        Py_DECREF(uid);
        if (rc < 0) goto done;
        if (rc > 0) {
            out = Py_NewRef(Py_None);
            goto done;
        }
    }
    PyObject *uid, *send;
    Py_ssize_t at = 0, place = 0;
    while (PyDict_Next(planned, &at, &uid, &send)) {
        PyObject *v = PyLong_FromSsize_t(place++);
        int rc = v == NULL ? -1 : PyDict_SetItem(pos, uid, v);
        Py_XDECREF(v);
        if (rc < 0) goto done;
    }
    at = 0;
    while (PyDict_Next(planned, &at, &uid, &send)) {
        PyObject *after = PyObject_GetAttr(send, str_after_d);
        if (after == NULL) goto done;
        if (!PyTuple_CheckExact(after)) {
            Py_DECREF(after);
            out = Py_NewRef(Py_None);
            goto done;
        }
        Py_INCREF(uid); /* planned is not changed here; kept for the call all the same */
        int rc = index_one(planned, uid, after, held, waiting, free);
        Py_DECREF(uid);
        Py_DECREF(after);
        if (rc < 0) goto done;
    }
    out = PyTuple_Pack(5, planned, pos, held, waiting, free);
done:
    Py_XDECREF(planned);
    Py_XDECREF(pos);
    Py_XDECREF(held);
    Py_XDECREF(waiting);
    Py_XDECREF(free);
    return out;
}

/* list_diff(old, new) -> (fresh, gone) | None: the objects of `new` not in `old` (in new's
   order) and those of `old` not in `new` (in old's order), by identity, where `new` is `old`
   with some objects taken out and others added after them (STFBook.sync: the simulator's
   pending updates, a dict's values, issue 24). None where that does not hold, or where an
   object of `new` is listed twice or was in `old` out of order: the caller's set operations
   then. A walk of pointers, and a scan of `old` per object added. */
PyObject *py_list_diff(PyObject *self, PyObject *args) {
    PyObject *old, *new;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &old, &PyList_Type, &new)) return NULL;
    Py_ssize_t n_old = PyList_GET_SIZE(old), n_new = PyList_GET_SIZE(new), i = 0, j = 0;
    PyObject *fresh = PyList_New(0), *gone = PyList_New(0), *out = NULL;
    if (fresh == NULL || gone == NULL) goto done;
    for (; j < n_new; j++) {
        PyObject *x = PyList_GET_ITEM(new, j);
        while (i < n_old && PyList_GET_ITEM(old, i) != x) /* taken out */
            if (PyList_Append(gone, PyList_GET_ITEM(old, i++)) < 0) goto done;
        if (i == n_old) break;
        i++; /* the same object, in its place */
    }
    while (i < n_old) /* after the last object kept: taken out */
        if (PyList_Append(gone, PyList_GET_ITEM(old, i++)) < 0) goto done;
    for (; j < n_new; j++) { /* the rest: added, unless in `old` or listed twice */
        PyObject *x = PyList_GET_ITEM(new, j);
        if ((double)n_old * (double)(PyList_GET_SIZE(fresh) + 1) > 1e7) { /* (scans too long: sets) */
            out = Py_NewRef(Py_None);
            goto done;
        }
        for (Py_ssize_t q = 0; q < n_old; q++)
            if (PyList_GET_ITEM(old, q) == x) {
                out = Py_NewRef(Py_None);
                goto done;
            }
        for (Py_ssize_t q = 0; q < PyList_GET_SIZE(fresh); q++)
            if (PyList_GET_ITEM(fresh, q) == x) {
                out = Py_NewRef(Py_None);
                goto done;
            }
        if (PyList_Append(fresh, x) < 0) goto done;
    }
    out = PyTuple_Pack(2, fresh, gone);
done:
    Py_XDECREF(fresh);
    Py_XDECREF(gone);
    return out;
}
