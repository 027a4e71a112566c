/* The STF planner in C (see plan_stf.c): Planner.accept, the set-up from the planner's state, the entry. */
#include "plan_stf.h"

/* ------------------------------------------------------------------ servers */

/* stf_planner._bound: default for None, the int itself, else value.get(server, default) */
static PyObject *bound_of(PyObject *value, PyObject *server, PyObject *dflt) {
    if (value == Py_None || PyLong_Check(value)) {
        PyObject *out = value == Py_None ? dflt : value;
        Py_INCREF(out);
        return out;
    }
    return PyObject_CallMethodObjArgs(value, s_get, server, dflt, NULL);
}

/* the index of `server`'s record, -1 on error */
static Py_ssize_t server_index(STF *st, PyObject *server) {
    PyObject *ix = PyDict_GetItemWithError(st->srv_ix, server);
    if (ix != NULL) return PyLong_AsSsize_t(ix);
    if (PyErr_Occurred()) return -1;
    if (stf_grow((void **)&st->s, &st->scap, st->ns + 1, sizeof(Srv)) < 0) return -1;
    Srv *s = &st->s[st->ns];
    memset(s, 0, sizeof(*s));
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL) return -1;
    PyObject *version = bound_of(st->server_version, server, zero); /* ... or 0 */
    int truth = version ? PyObject_IsTrue(version) : -1;
    if (truth == 0) Py_SETREF(version, Py_NewRef(zero));
    PyObject *bound = truth >= 0 ? bound_of(st->tau_max, server, Py_None) : NULL;
    PyObject *ahead = bound ? PyDict_GetItemWithError(st->ahead, server) : NULL; /* Counter: 0 if missing */
    if (bound == NULL || (ahead == NULL && PyErr_Occurred())) {
        Py_DECREF(zero);
        Py_XDECREF(version);
        Py_XDECREF(bound);
        return -1;
    }
    /* a negative tau_max bounds nothing: kept as no bound (delay_drop's fast path) */
    int nonneg = bound == Py_None ? 0 : PyObject_RichCompareBool(bound, zero, Py_GE);
    if (nonneg < 0) {
        Py_DECREF(zero);
        Py_DECREF(version);
        Py_DECREF(bound);
        return -1;
    }
    s->version = version;
    s->ahead = Py_NewRef(ahead ? ahead : zero);
    Py_DECREF(zero);
    if (!nonneg)
        Py_DECREF(bound);
    else
        s->bound = bound;
    PyObject *v = PyLong_FromSsize_t(st->ns);
    if (v == NULL || PyDict_SetItem(st->srv_ix, server, v) < 0) {
        Py_XDECREF(v);
        Py_CLEAR(s->version);
        Py_CLEAR(s->ahead);
        Py_CLEAR(s->bound);
        return -1;
    }
    Py_DECREF(v);
    return st->ns++;
}

/* ------------------------------------------------------------------ Planner.accept */

/* 1: uid's expected delay exceeds tau_max (dropped, reason recorded), 0: not, -1: error */
static int delay_drop(STF *st, PyObject *uo, PyObject *uid, PyObject *row) {
    PyObject *server = row ? Py_NewRef(PyTuple_GET_ITEM(row, 5)) : PyObject_GetAttr(uo, str_server);
    if (server == NULL) return -1;
    Py_ssize_t si = server_index(st, server);
    Py_DECREF(server);
    if (si < 0) return -1;
    Srv *s = &st->s[si];
    if (s->bound == NULL) { /* no tau_max (or a negative one): never dropped, the delay is not needed */
        s->accepted++;
        return 0;
    }
    PyObject *base = PyObject_GetAttr(uo, s_base_version);
    PyObject *done = base ? PyLong_FromLong(s->accepted) : NULL;
    PyObject *n_ahead = done ? PyNumber_Add(s->ahead, done) : NULL;
    PyObject *behind = n_ahead ? PyNumber_Subtract(s->version, base) : NULL;
    PyObject *delay = behind ? PyNumber_Add(behind, n_ahead) : NULL;
    int over = delay ? PyObject_RichCompareBool(delay, s->bound, Py_GT) : -1; /* bound >= 0 here */
    if (over > 0) {
        PyObject *reason = PyObject_CallFunctionObjArgs(st->drop_reason, delay, s->bound, s->version, base, n_ahead, NULL);
        over = reason == NULL || PyDict_SetItem(st->drops, uid, reason) < 0 ? -1 : 1;
        Py_XDECREF(reason);
    } else if (over == 0) {
        s->accepted++;
    }
    Py_XDECREF(base);
    Py_XDECREF(done);
    Py_XDECREF(n_ahead);
    Py_XDECREF(behind);
    Py_XDECREF(delay);
    return over;
}

/* the updates of first_link_members that are not gone, each moved to its path's class; the
   classes they leave and join appended to *moved. 0 or -1. */
/* the index of `uid`, listed in a class whose head has not reached it yet: made as the head
   would make it (its bytes as the planner lists them, float(by_id[uid].bytes); its class
   class_of's, else class_index's); -1 on error */
static Py_ssize_t untaken(STF *st, PyObject *uid) {
    PyObject *uo = PyDict_GetItemWithError(st->by_id, uid);
    if (uo == NULL) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_SystemError, "stf_run: %R is in no class", uid);
        return -1;
    }
    PyObject *size = PyObject_GetAttr(uo, s_bytes);
    double nbytes = size ? PyFloat_AsDouble(size) : -1.0;
    Py_XDECREF(size);
    if (nbytes == -1.0 && PyErr_Occurred()) return -1;
    PyObject *own = PyDict_GetItemWithError(st->class_of, uid);
    if (own == NULL && PyErr_Occurred()) return -1;
    PyObject *got = own ? Py_NewRef(own) : PyObject_CallOneArg(st->class_index, uid);
    Py_ssize_t ci = got ? PyLong_AsSsize_t(got) : -1;
    Py_XDECREF(got);
    if (ci == -1 && PyErr_Occurred()) return -1;
    if (ci < 0 || ci >= st->nc) {
        PyErr_Format(PyExc_SystemError, "stf_run: %R is in no class", uid);
        return -1;
    }
    int fresh;
    Py_ssize_t ui = stf_uid_index(st, uid, nbytes, &fresh);
    if (ui >= 0) st->u[ui].cls = ci;
    return ui;
}

static int move_one(STF *st, PyObject *other, Py_ssize_t **moved, Py_ssize_t *nm, Py_ssize_t *cap) {
    PyObject *ix = PyDict_GetItemWithError(st->uid_ix, other);
    if (ix == NULL && (PyErr_Occurred() || st->class_index == NULL)) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_SystemError, "stf_run: %R is in no class", other);
        return -1;
    }
    Py_ssize_t oi = ix ? PyLong_AsSsize_t(ix) : untaken(st, other);
    if (oi < 0) return -1;
    if (st->u[oi].gone) return 0;
    if (stf_grow((void **)moved, cap, *nm + 2, sizeof(Py_ssize_t)) < 0) return -1;
    (*moved)[(*nm)++] = st->u[oi].cls;
    Py_ssize_t ni = stf_add_exact(st, oi);
    if (ni < 0) return -1;
    (*moved)[(*nm)++] = ni;
    return 0;
}

/* Planner.first_link_members (and _BookPlanner's) of link li, each moved (move_one): the
   planner's own list popped, then the book's updates on the link unless taken before */
static int move_first_link_members(STF *st, Py_ssize_t li, Py_ssize_t **moved, Py_ssize_t *nm, Py_ssize_t *cap) {
    PyObject *link = st->l[li].key;
    if (PyDict_GET_SIZE(st->on_first_link)) {
        PyObject *own = PyDict_GetItemWithError(st->on_first_link, link);
        if (own != NULL) {
            PyObject *fast = PySequence_Fast(own, "on_first_link: a sequence of ids");
            int rc = fast == NULL ? -1 : PyDict_DelItem(st->on_first_link, link);
            for (Py_ssize_t q = 0; rc == 0 && q < PySequence_Fast_GET_SIZE(fast); q++)
                rc = move_one(st, PySequence_Fast_GET_ITEM(fast, q), moved, nm, cap);
            Py_XDECREF(fast);
            if (rc < 0) return -1;
        } else if (PyErr_Occurred()) {
            return -1;
        }
    }
    Lnk *l = &st->l[li];
    if (st->book_on_link == Py_None || l->popped) return 0;
    if (!l->popped_known) { /* popped before run() (a NIC in use) */
        int seen = PySet_Contains(st->popped, link);
        if (seen < 0) return -1;
        l->popped_known = 1;
        l->popped = (char)seen;
        if (seen) return 0;
    }
    l->popped = 1;
    PyObject *keys = PyDict_GetItemWithError(st->book_on_link, link);
    if (keys == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!PyDict_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "stf_run: the book's updates on a link must be a dict");
        return -1;
    }
    Py_INCREF(keys); /* the book does not change it while we walk it */
    PyObject *other, *value;
    Py_ssize_t pos = 0;
    int rc = 0;
    while (rc == 0 && PyDict_Next(keys, &pos, &other, &value)) rc = move_one(st, other, moved, nm, cap);
    Py_DECREF(keys);
    return rc;
}

static int cmp_index(const void *a, const void *b) {
    Py_ssize_t x = *(const Py_ssize_t *)a, y = *(const Py_ssize_t *)b;
    return (x > y) - (x < y);
}

/* the transfer of ui: Timelines.reserve on its path, as a Transfer appended to st->transfers */
static int reserve(STF *st, Py_ssize_t ci, Py_ssize_t ui, double nbytes, PyObject *uo) {
    Py_ssize_t nl;
    Py_ssize_t *lk = stf_links_of(st, ui, &nl);
    if (lk == NULL) return -1;
    for (Py_ssize_t k = 0; k < nl; k++) /* the timelines made in path order, as Timelines._native does */
        if (stf_realize(st, lk[k]) < 0) return -1;
    PyObject *uid = st->u[ui].uid, *links = st->u[ui].links, *start_o = st->c[ci].start_o;
    PyObject *got = Py_None;
    Py_INCREF(got);
    if (PyFloat_CheckExact(start_o)) { /* fast_transfer on the lists the links were read from (floats) */
        Lane lanes[MAX_LINKS];
        for (Py_ssize_t k = 0; k < nl; k++) {
            Lnk *l = &st->l[lk[k]];
            lanes[k] = (Lane){l->times, l->residual, l->eps, NULL};
        }
        Py_DECREF(got);
        got = lanes_transfer(lanes, links, nbytes, start_o, PyUnicode_GET_LENGTH(uid) ? uid : a_transfer,
                             st->reservation_cls);
        if (got == NULL) return -1;
    }
    if (got == Py_None) { /* the Python method: it raises where the C declined */
        Py_DECREF(got);
        if (stf_flush(st) < 0) return -1; /* the Python reads the Timelines */
        PyObject *nb = PyFloat_FromDouble(nbytes);
        PyObject *args = nb ? PyTuple_Pack(3, links, nb, start_o) : NULL;
        PyObject *kw = args ? Py_BuildValue("{OO}", s_who, uid) : NULL;
        PyObject *meth = kw ? PyObject_GetAttr(st->tls, s_reserve) : NULL;
        got = meth ? PyObject_Call(meth, args, kw) : NULL;
        Py_XDECREF(nb);
        Py_XDECREF(args);
        Py_XDECREF(kw);
        Py_XDECREF(meth);
        if (got == NULL) return -1;
    }
    st->stamp++;
    for (Py_ssize_t k = 0; k < nl; k++) {
        Lnk *l = &st->l[lk[k]];
        l->modified = st->stamp;
        l->free_ok = l->peak_ok = 0;
    }
    PyObject *row = st->u[ui].row, *src, *dst, *size; /* the book's row, else the update's attributes */
    if (row != NULL) {
        src = Py_NewRef(PyTuple_GET_ITEM(row, 2));
        dst = Py_NewRef(PyTuple_GET_ITEM(row, 3));
        size = Py_NewRef(PyTuple_GET_ITEM(row, 4));
    } else {
        src = PyObject_GetAttr(uo, str_src);
        dst = src ? PyObject_GetAttr(uo, s_dst) : NULL;
        size = dst ? PyObject_GetAttr(uo, s_bytes) : NULL;
    }
    PyObject *path = size ? PyTuple_New(nl + 1) : NULL;
    PyObject *name = Py_NewRef(uid), *t = NULL;
    if (path != NULL) {
        PyTuple_SET_ITEM(path, 0, Py_NewRef(src));
        for (Py_ssize_t k = 0; k < nl; k++)
            PyTuple_SET_ITEM(path, k + 1, Py_NewRef(PyTuple_GET_ITEM(PyTuple_GET_ITEM(links, k), 1)));
        if (st->names != Py_None) Py_SETREF(name, PyObject_GetItem(st->names, uid));
        untrack_atoms(path);
        if (name != NULL && PyTuple_CheckExact(got) && PyTuple_GET_SIZE(got) == 3 && st->reservation_cls == Py_None) {
            /* the light row: TransferTimes(name, src, dst, path, start, end, bytes, False) */
            PyTypeObject *type = (PyTypeObject *)st->transfer_cls;
            PyObject *argv[8] = {name, src, dst, path, PyTuple_GET_ITEM(got, 0), PyTuple_GET_ITEM(got, 1), size, Py_False};
            if ((t = type->tp_alloc(type, 8)) != NULL) {
                for (Py_ssize_t k = 0; k < 8; k++) PyTuple_SET_ITEM(t, k, Py_NewRef(argv[k]));
                untrack_leaves(t);
            }
        } else if (name != NULL && PyTuple_CheckExact(got) && PyTuple_GET_SIZE(got) == 3) {
            PyObject *argv[9] = {name, src, dst, path, PyTuple_GET_ITEM(got, 0), PyTuple_GET_ITEM(got, 1), size,
                                 PyTuple_GET_ITEM(got, 2), Py_False};
            t = make_instance(st->transfer_cls, st->fields, argv, st->fields == Py_None ? 8 : 9);
        } else if (name != NULL)
            PyErr_SetString(PyExc_TypeError, "Timelines.reserve must return (start, end, reservations)");
    }
    int rc = t == NULL ? -1 : PyList_Append(st->transfers, t);
    Py_XDECREF(t);
    Py_XDECREF(name);
    Py_XDECREF(path);
    Py_XDECREF(size);
    Py_XDECREF(dst);
    Py_XDECREF(src);
    Py_DECREF(got);
    return rc;
}

int stf_accept(STF *st, Py_ssize_t ci, Py_ssize_t ui, double nbytes) {
    PyObject *uid = st->u[ui].uid;
    PyObject *uo = PyDict_GetItemWithError(st->by_id, uid);
    if (uo == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, uid);
        return -1;
    }
    st->u[ui].gone = 1;
    int over = delay_drop(st, uo, uid, st->u[ui].row);
    if (over != 0) return over < 0 ? -1 : stf_place(st, ci);
    if (reserve(st, ci, ui, nbytes, uo) < 0) return -1;
    /* the updates whose class was their untouched first link move to their path's class */
    Py_ssize_t *moved = NULL, nm = 0, cap = 0;
    if (stf_grow((void **)&moved, &cap, 1, sizeof(Py_ssize_t)) < 0) return -1;
    moved[nm++] = ci;
    Py_ssize_t nl = 0;
    Py_ssize_t *lk = stf_links_of(st, ui, &nl); /* moving members resolves no links: lk stays put */
    int rc = lk == NULL ? -1 : 0;
    for (Py_ssize_t k = 0; k < nl && rc == 0; k++) rc = move_first_link_members(st, lk[k], &moved, &nm, &cap);
    if (rc == 0) {
        qsort(moved, (size_t)nm, sizeof(Py_ssize_t), cmp_index);
        for (Py_ssize_t q = 0; q < nm && rc == 0; q++)
            if (q == 0 || moved[q] != moved[q - 1]) rc = stf_place(st, moved[q]);
    }
    PyMem_Free(moved);
    return rc;
}

/* ------------------------------------------------------------------ set-up and the entry */

static void release(STF *st) {
    for (Py_ssize_t i = 0; i < st->nu; i++) {
        Py_DECREF(st->u[i].uid);
        Py_XDECREF(st->u[i].links);
        Py_XDECREF(st->u[i].row);
    }
    for (Py_ssize_t i = 0; i < st->nl; i++) {
        Py_XDECREF(st->l[i].key);
        if (st->l[i].own) {
            Py_DECREF(st->l[i].times);
            Py_DECREF(st->l[i].residual);
        }
        PyMem_Free(st->l[i].g);
    }
    for (Py_ssize_t i = 0; i < st->nc; i++) {
        Py_DECREF(st->c[i].start_o);
        PyMem_Free(st->c[i].m);
        PyMem_Free(st->c[i].ex_p);
    }
    for (Py_ssize_t i = 0; i < st->ns; i++) {
        Py_XDECREF(st->s[i].version);
        Py_XDECREF(st->s[i].bound);
        Py_XDECREF(st->s[i].ahead);
    }
    PyMem_Free(st->u);
    PyMem_Free(st->l);
    PyMem_Free(st->c);
    PyMem_Free(st->s);
    PyMem_Free(st->pool);
    PyMem_Free(st->heap);
    PyMem_Free(st->scratch);
    PyMem_Free(st->made);
    PyMem_Free(st->slot_of);
    Py_XDECREF(st->uid_ix);
    Py_XDECREF(st->link_ix);
    Py_XDECREF(st->srv_ix);
    Py_XDECREF(st->transfers);
    Py_XDECREF(st->t0_o);
}

/* whether every timeline the Timelines has holds float lists (else: the Python loop) */
static int float_timelines(PyObject *tls_links) {
    PyObject *key, *tl;
    Py_ssize_t pos = 0;
    while (PyDict_Next(tls_links, &pos, &key, &tl)) {
        for (int k = 0; k < 2; k++) {
            PyObject *list = PyObject_GetAttr(tl, k ? str_residual : str_times);
            if (list == NULL) return -1;
            int ok = PyList_CheckExact(list) && PyList_GET_SIZE(list) > 0 && all_floats(list);
            Py_DECREF(list);
            if (!ok) return 0;
        }
    }
    return 1;
}

/* whether a listed member is (float nbytes, str uid), as the C reads it */
static inline int member_ok(PyObject *m) {
    return PyTuple_CheckExact(m) && PyTuple_GET_SIZE(m) == 2 && PyFloat_CheckExact(PyTuple_GET_ITEM(m, 0)) &&
           PyUnicode_CheckExact(PyTuple_GET_ITEM(m, 1));
}

int stf_take(STF *st, Py_ssize_t ci) {
    Cls *c = &st->c[ci];
    if (c->pq >= PyList_GET_SIZE(c->pm)) { /* (the list shrank under us: it must not change) */
        PyErr_SetString(PyExc_RuntimeError, "stf_run: a class's member list changed during the run");
        return -1;
    }
    PyObject *m = PyList_GET_ITEM(c->pm, c->pq); /* (nbytes, uid): checked here unless by set_up */
    if (!c->checked && !member_ok(m)) {
        PyErr_SetString(PyExc_TypeError, "stf_run: a class's members must be (float bytes, str id) tuples");
        return -1;
    }
    PyObject *uid = PyTuple_GET_ITEM(m, 1);
    c->pq++;
    int fresh;
    Py_ssize_t ui = stf_uid_index(st, uid, PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(m, 0)), &fresh);
    if (ui < 0 || stf_class_append(&st->c[ci], ui) < 0) return -1;
    if (!fresh) return 0;
    PyObject *own = PyDict_GetItemWithError(st->class_of, uid); /* else: the class listing it */
    if (own == NULL && PyErr_Occurred()) return -1;
    st->u[ui].cls = own ? PyLong_AsSsize_t(own) : ci;
    return st->u[ui].cls == -1 && PyErr_Occurred() ? -1 : 0;
}

int stf_take_all(STF *st, Py_ssize_t ci) {
    while (st->c[ci].pm != NULL && st->c[ci].pq < st->c[ci].pn)
        if (stf_take(st, ci) < 0) return -1;
    return 0;
}

/* the classes as the planner holds them: `shared`'s member lists (NULL: none) from `now_o`
   with head 0, then `classes`' (start, members, head); 1, 0 (not as the C expects: the Python
   loop), -1. With the planner's class_index, a class's members are taken as its head reaches
   them (a decision plans the head of ~1,000 pending updates: most are never looked at, issue
   24), and checked then (a member not as the C reads it raises TypeError there); a member is
   indexed as it would have been here, in the class listing it unless class_of says otherwise
   (the planner lists an update in two classes only after class_of has it). */
static int set_up(STF *st, PyObject *classes, PyObject *shared) {
    Py_ssize_t ns = shared ? PyList_GET_SIZE(shared) : 0;
    for (Py_ssize_t ci = 0; ci < ns; ci++)
        if (!PyList_CheckExact(PyList_GET_ITEM(shared, ci))) return 0;
    for (Py_ssize_t ci = 0; ci < PyList_GET_SIZE(classes); ci++) {
        PyObject *cls = PyList_GET_ITEM(classes, ci); /* (start, members, head) */
        if (!PyTuple_CheckExact(cls) || PyTuple_GET_SIZE(cls) != 3) return 0;
        PyObject *start = PyTuple_GET_ITEM(cls, 0), *members = PyTuple_GET_ITEM(cls, 1);
        if (!PyFloat_CheckExact(start) || !PyList_CheckExact(members) || !PyLong_CheckExact(PyTuple_GET_ITEM(cls, 2)))
            return 0;
    }
    for (Py_ssize_t ci = 0; ci < ns + PyList_GET_SIZE(classes); ci++) {
        PyObject *cls = ci < ns ? NULL : PyList_GET_ITEM(classes, ci - ns);
        PyObject *members = cls ? PyTuple_GET_ITEM(cls, 1) : PyList_GET_ITEM(shared, ci);
        Py_ssize_t head = cls ? PyLong_AsSsize_t(PyTuple_GET_ITEM(cls, 2)) : 0;
        if (head == -1 && PyErr_Occurred()) return -1;
        int lazy = st->class_index != NULL && head == 0;
        if (!lazy) /* (a head moved on: what is before it is taken too; the Python loop if not as expected) */
            for (Py_ssize_t q = 0; q < PyList_GET_SIZE(members); q++)
                if (!member_ok(PyList_GET_ITEM(members, q))) return 0;
        if (stf_new_class(st, cls ? PyTuple_GET_ITEM(cls, 0) : st->now_o) != ci) return -1;
        Cls *c = &st->c[ci];
        c->head = head;
        c->pm = members; /* the planner keeps its lists for the whole run */
        c->pn = PyList_GET_SIZE(c->pm);
        c->checked = (char)!lazy;
        if (!lazy && stf_take_all(st, ci) < 0) return -1;
    }
    return 1;
}

PyObject *py_stf_run(PyObject *self, PyObject *args) {
    STF st;
    memset(&st, 0, sizeof(st));
    PyObject *classes, *ix_of = Py_None, *link_list = Py_None, *cap_cache = Py_None, *class_index = Py_None;
    PyObject *shared = Py_None;
    int keep = 1;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "O!O!O!O!OOO!O!OOOOO!nOO!O!dOOOOOdOO!|OOOOpO", &PyList_Type, &classes, &PyDict_Type,
                          &st.class_of, &PyDict_Type, &st.class_of_key, &PyDict_Type, &st.on_first_link,
                          &st.book_on_link, &st.popped, &PyDict_Type, &st.by_id, &PyDict_Type, &st.links_of,
                          &st.names, &st.now_o, &st.tau_max, &st.server_version, &PyDict_Type, &st.ahead, &limit,
                          &st.tls, &PyDict_Type, &st.tls_links, &PyDict_Type, &st.succ, &st.t0, &st.profiles,
                          &st.transfer_cls, &st.fields, &st.reservation_cls, &st.timeline_cls, &st.eps,
                          &st.drop_reason, &PyDict_Type, &st.drops, &ix_of, &link_list, &cap_cache, &class_index, &keep,
                          &shared))
        return NULL;
    if (shared != Py_None && !PyList_CheckExact(shared)) {
        PyErr_SetString(PyExc_TypeError, "stf_run: shared must be a list of member lists");
        return NULL;
    }
    st.keep = (char)keep;
    if (class_index != Py_None) {
        if (!PyCallable_Check(class_index)) {
            PyErr_SetString(PyExc_TypeError, "stf_run: class_index must be callable");
            return NULL;
        }
        st.class_index = class_index;
    }
    if (ix_of != Py_None) {
        if (!PyDict_Check(ix_of) || !PyList_CheckExact(link_list) || !PyList_CheckExact(cap_cache) ||
            PyList_GET_SIZE(cap_cache) != PyList_GET_SIZE(link_list)) {
            PyErr_SetString(PyExc_TypeError,
                            "stf_run: link numbers need a dict, and lists of links and of capacities of one length");
            return NULL;
        }
        st.ix_of = ix_of;
        st.link_list = link_list;
        st.cap_cache = cap_cache;
    }
    if (st.reservation_cls == Py_None &&
        (!PyType_Check(st.transfer_cls) || !PyType_IsSubtype((PyTypeObject *)st.transfer_cls, &PyTuple_Type))) {
        PyErr_SetString(PyExc_TypeError, "stf_run: without reservations the transfers' class must be a tuple's");
        return NULL;
    }
    if (st.book_on_link != Py_None && (!PyDict_Check(st.book_on_link) || !PyAnySet_Check(st.popped))) {
        PyErr_SetString(PyExc_TypeError, "stf_run: book links must be a dict and popped a set");
        return NULL;
    }
    if (s_capacity == NULL) {
        s_capacity = PyUnicode_InternFromString("capacity");
        s_ready_at = PyUnicode_InternFromString("ready_at");
        s_base_version = PyUnicode_InternFromString("base_version");
        s_dst = PyUnicode_InternFromString("dst");
        s_bytes = PyUnicode_InternFromString("bytes");
        s_path_tag = PyUnicode_InternFromString("path");
        s_get = PyUnicode_InternFromString("get");
        s_rates = PyUnicode_InternFromString("rates");
        s_reserve = PyUnicode_InternFromString("reserve");
        s_who = PyUnicode_InternFromString("who");
        if (!s_capacity || !s_ready_at || !s_base_version || !s_dst || !s_bytes || !s_path_tag || !s_get ||
            !s_rates || !s_reserve || !s_who) {
            Py_CLEAR(s_capacity);
            return NULL;
        }
    }
    if (!PyFloat_CheckExact(st.now_o)) Py_RETURN_NONE;
    st.now = PyFloat_AS_DOUBLE(st.now_o);
    int ok = float_timelines(st.tls_links);
    if (ok <= 0) return ok < 0 ? NULL : Py_NewRef(Py_None);
    st.transfers = PyList_New(0);
    st.uid_ix = PyDict_New();
    st.link_ix = PyDict_New();
    st.srv_ix = PyDict_New();
    if (!st.transfers || !st.uid_ix || !st.link_ix || !st.srv_ix) {
        release(&st);
        return NULL;
    }
    if (st.ix_of != NULL) { /* no slot yet for any book link number */
        st.nbook = PyList_GET_SIZE(st.link_list);
        st.slot_of = PyMem_Calloc((size_t)(st.nbook ? st.nbook : 1), sizeof(int32_t));
        if (st.slot_of == NULL) {
            PyErr_NoMemory();
            release(&st);
            return NULL;
        }
    }
    ok = set_up(&st, classes, shared == Py_None ? NULL : shared);
    if (ok <= 0) {
        release(&st);
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    }
    if (stf_loop(&st, limit) < 0) {
        if (st.keep) { /* the Timelines as the loop left it, as the Python loop would */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            if (stf_flush(&st) < 0) PyErr_Clear();
            PyErr_Restore(type, value, tb);
        }
        release(&st);
        return NULL;
    }
    if (st.keep && stf_flush(&st) < 0) {
        release(&st);
        return NULL;
    }
    PyObject *out = Py_NewRef(st.transfers);
    release(&st);
    return out;
}
