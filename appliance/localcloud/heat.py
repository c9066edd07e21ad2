"""The local cloud's Heat v1 API: stack create / show / list / delete with outputs, events and resources.

Enough of Heat for heat-templates/horovod-cluster.yaml, done the way Heat does it: the HOT version is checked,
parameters are validated against their constraints, resources are created in dependency order (references
through get_resource / get_attr), intrinsic functions are evaluated (get_param with the OS:: pseudo
parameters, get_attr with attribute paths, get_resource, str_replace, list_join, yaql through OpenStack's own
yaql library), and servers are booted through the same Nova code path as the compute API, so their user_data
runs on the testbed node as cloud-init would run it. Creation runs in the background (CREATE_IN_PROGRESS
-> CREATE_COMPLETE | CREATE_FAILED, with the reason), as on Heat.
"""

from __future__ import annotations

import base64
import copy
import re
import threading
import time
import traceback
import uuid

import yaml

from .state import Keypair

HOT_VERSIONS = ("2013-05-23", "2014-10-16", "2015-04-30", "2015-10-15", "2016-04-08", "2016-10-14", "2017-02-24",
                "2017-09-01", "2018-03-02", "2018-08-31")
YAQL_SINCE = "2016-10-14"
SUPPORTED = ("OS::Nova::KeyPair", "OS::Heat::ResourceGroup", "OS::Nova::Server", "OS::Neutron::FloatingIP",
             "OS::Neutron::FloatingIPAssociation")


class HeatError(Exception):
    def __init__(self, code: int, message: str, title: str = "Bad Request"):
        super().__init__(message)
        self.code, self.message, self.title = code, message, title


def _refs(value) -> set[str]:
    """Names of the resources a property value refers to."""
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "get_resource" and isinstance(v, str):
                out.add(v)
            elif k == "get_attr" and isinstance(v, list) and v:
                out.add(v[0])
            out |= _refs(v)
    elif isinstance(value, list):
        for v in value:
            out |= _refs(v)
    return out


def _replace_index(value, i: int):
    if isinstance(value, str):
        return value.replace("%index%", str(i))
    if isinstance(value, dict):
        return {k: _replace_index(v, i) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_index(v, i) for v in value]
    return value


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Stack:
    def __init__(self, sid: str, name: str, template: dict, params: dict, project: str):
        self.id, self.name, self.template, self.params, self.project = sid, name, template, params, project
        self.status, self.reason = "CREATE_IN_PROGRESS", "Stack CREATE started"
        self.resources: dict[str, dict] = {}  # name -> {"type", "attrs", "servers": [...], "fips": [...]}
        self.outputs: list[dict] = []
        self.created = _now()
        # what the events and resources APIs show (heat/engine/api.py format_event, format_stack_resource): every
        # state change in order, and each template resource's latest one (INIT_COMPLETE before its creation)
        self.events: list[dict] = []
        self.states: dict[str, dict] = {n: {"status": "INIT_COMPLETE", "reason": "", "physical": "", "time": None}
                                        for n in (template.get("resources") or {})}
        self.lock = threading.Lock()

    def event(self, resource: str, status: str, reason: str, physical: str = "", rtype: str = "") -> None:
        """A state change of the stack itself (``resource`` = its name) or of one of its resources."""
        with self.lock:
            self.events.append({"id": str(uuid.uuid4()), "event_time": _now(), "resource_name": resource,
                                "physical_resource_id": physical, "resource_status": status,
                                "resource_status_reason": reason, "resource_type": rtype})
            if resource in self.states:
                st = self.states[resource]
                st.update(status=status, reason=reason, physical=physical or st["physical"], time=_now())

    def view(self, base: str) -> dict:
        return {"id": self.id, "stack_name": self.name, "stack_status": self.status,
                "stack_status_reason": self.reason, "creation_time": self.created, "updated_time": None,
                "description": self.template.get("description", ""), "parameters": {
                    **{k: str(v) for k, v in self.params.items()}, "OS::stack_name": self.name,
                    "OS::stack_id": self.id, "OS::project_id": self.project},
                "outputs": self.outputs if self.status == "CREATE_COMPLETE" else [],
                "template_description": self.template.get("description", ""), "timeout_mins": None,
                "disable_rollback": True, "capabilities": [], "notification_topics": [], "tags": None,
                "links": [{"href": f"{base}/stacks/{self.name}/{self.id}", "rel": "self"}]}


class Heat:
    def __init__(self, cloud, new_id):
        self.cloud, self.new_id = cloud, new_id
        self.stacks: dict[str, Stack] = {}

    # -- validation ------------------------------------------------------------------------------------------
    def _params(self, tpl: dict, given: dict) -> dict:
        out = {}
        for name, p in (tpl.get("parameters") or {}).items():
            if name in given:
                v = given[name]
            elif "default" in p:
                v = p["default"]
            else:
                raise HeatError(400, f"The Parameter ({name}) was not provided.", "Bad Request")
            if p.get("type") == "number":
                try:
                    v = int(v) if re.fullmatch(r"-?\d+", str(v)) else float(v)
                except ValueError:
                    raise HeatError(400, f"Parameter '{name}' is invalid: could not convert string to float: "
                                         f"'{v}'") from None
            for c in p.get("constraints") or []:
                r = c.get("range")
                if r and not (r.get("min", v) <= v <= r.get("max", v)):
                    raise HeatError(400, f"Parameter '{name}' is invalid: {c.get('description') or r}")
                if c.get("custom_constraint") == "blazar.reservation" and not self.cloud.reservation(str(v))[1]:
                    raise HeatError(400, f"Parameter '{name}' is invalid: Error validating value '{v}': "
                                         f"The Reservation ({v}) could not be found.")
            out[name] = v
        unknown = set(given) - set(out)
        if unknown:
            raise HeatError(400, f"The Parameter ({sorted(unknown)[0]}) was not defined in template.")
        return out

    def create(self, body: dict, base: str) -> Stack:
        name = body.get("stack_name") or ""
        if not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9_.-]{0,254}", name):
            raise HeatError(400, f"Invalid stack name {name} must contain only alphanumeric or \"_-.\" characters, "
                                 "must start with alpha")
        if any(s.name == name and s.status != "DELETE_COMPLETE" for s in self.stacks.values()):
            raise HeatError(409, f"The Stack ({name}) already exists.", "Conflict")
        tpl = body.get("template")
        if isinstance(tpl, str):
            tpl = yaml.safe_load(tpl)
        if not isinstance(tpl, dict):
            raise HeatError(400, "The template is not a JSON object or YAML mapping.")
        version = str(tpl.get("heat_template_version", ""))
        if version not in HOT_VERSIONS:
            raise HeatError(400, f"\"{version}\" is not a valid heat_template_version: should be one of "
                                 f"{', '.join(HOT_VERSIONS)}")
        for rname, r in (tpl.get("resources") or {}).items():
            if r.get("type") not in SUPPORTED:
                raise HeatError(400, f"The Resource Type ({r.get('type')}) could not be found.", "Not Found")
            if r.get("type") == "OS::Nova::KeyPair" and not (r.get("properties") or {}).get("public_key"):
                # heat/engine/resources/openstack/nova/keypair.py KeyPair.validate: from Nova microversion 2.92
                # on, Nova no longer makes key pairs, and Heat asks for public_key. Chameleon runs Nova 2023.1
                # (up to 2.95), which Heat uses; so a KeyPair without public_key fails validation there.
                raise HeatError(400, f"Property error: resources.{rname}: The public_key property is required by "
                                     "the nova API version currently used.")
            missing = _refs(r.get("properties")) - set(tpl["resources"])
            if missing:
                raise HeatError(400, f"The specified reference \"{sorted(missing)[0]}\" (in {rname}) is incorrect.")
        params = self._params(tpl, body.get("parameters") or {})
        st = Stack(self.new_id(), name, tpl, params, self.cloud.project_id)
        self.stacks[st.id] = st
        st.event(name, "CREATE_IN_PROGRESS", "Stack CREATE started", st.id, "OS::Heat::Stack")
        threading.Thread(target=self._create, args=(st,), daemon=True).start()
        return st

    def find(self, ident: str) -> Stack:
        for s in self.stacks.values():
            if (s.id == ident or s.name == ident) and s.status != "DELETE_COMPLETE":
                return s
        raise HeatError(404, f"The Stack ({ident}) could not be found.", "Not Found")

    # -- functions -------------------------------------------------------------------------------------------
    def resolve(self, st: Stack, value):
        if isinstance(value, list):
            return [self.resolve(st, v) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) == 1:
            (fn, arg), = value.items()
            if fn == "get_param":
                path = arg if isinstance(arg, list) else [arg]
                pseudo = {"OS::stack_name": st.name, "OS::stack_id": st.id, "OS::project_id": st.project}
                v = pseudo[path[0]] if path[0] in pseudo else st.params[path[0]]
                for k in path[1:]:
                    v = v[self.resolve(st, k)]
                return v
            if fn == "get_resource":
                return st.resources[arg]["id"]
            if fn == "get_attr":
                args = [self.resolve(st, a) for a in arg]
                v = st.resources[args[0]]["attrs"][args[1]]
                for k in args[2:]:
                    v = v[k]
                return v
            if fn == "str_replace":
                text = self.resolve(st, arg["template"])
                for k, v in (self.resolve(st, arg.get("params") or {})).items():
                    text = text.replace(k, v if isinstance(v, str) else str(v))
                return text
            if fn == "list_join":
                sep, *lists = [self.resolve(st, a) for a in arg]
                return sep.join(str(x) for lst in lists for x in lst)
            if fn == "yaql":
                if str(st.template["heat_template_version"]) < YAQL_SINCE:
                    raise HeatError(400, "yaql needs heat_template_version 2016-10-14 or later")
                import yaql

                engine = yaql.factory.YaqlFactory().create()
                data = self.resolve(st, arg.get("data") or {})
                return engine(arg["expression"]).evaluate(data={"data": data})
        return {k: self.resolve(st, v) for k, v in value.items()}

    # -- create / delete -------------------------------------------------------------------------------------
    def _create(self, st: Stack) -> None:
        try:
            todo = dict(st.template["resources"])
            while todo:
                ready = [n for n, r in todo.items() if not (_refs(r.get("properties")) & set(todo))]
                if not ready:
                    raise HeatError(400, "Circular dependency found: " + ", ".join(sorted(todo)))
                for n in ready:
                    self._create_resource(st, n, todo.pop(n))
            st.outputs = [{"output_key": k, "output_value": self.resolve(st, o.get("value")),
                           "description": o.get("description", "")}
                          for k, o in (st.template.get("outputs") or {}).items()]
            st.status, st.reason = "CREATE_COMPLETE", "Stack CREATE completed successfully"
        except Exception as e:
            if not isinstance(e, HeatError):
                traceback.print_exc()
            st.status = "CREATE_FAILED"
            st.reason = str(getattr(e, "message", e))
        st.event(st.name, st.status, st.reason, st.id, "OS::Heat::Stack")

    def _create_resource(self, st: Stack, name: str, r: dict) -> None:
        """One resource, with its events (heat/engine/resource.py: "state changed" on each transition)."""
        st.event(name, "CREATE_IN_PROGRESS", "state changed", rtype=r["type"])
        try:
            self._create_one(st, name, r)
        except Exception as e:
            st.event(name, "CREATE_FAILED", f"{type(e).__name__}: {getattr(e, 'message', e)}", rtype=r["type"])
            raise
        st.event(name, "CREATE_COMPLETE", "state changed", str(st.resources[name].get("id", "")), r["type"])

    def _create_one(self, st: Stack, name: str, r: dict) -> None:
        rtype = r["type"]
        if rtype == "OS::Heat::ResourceGroup":
            props = r.get("properties") or {}
            count = int(self.resolve(st, props.get("count", 1)))
            members: list[dict] = [{} for _ in range(count)]

            def one(i):
                d = _replace_index(copy.deepcopy(props["resource_def"]), i)
                members[i] = self._make(st, f"{name}-{i}", d["type"], self.resolve(st, d.get("properties") or {}))

            threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if any(not m for m in members):
                raise HeatError(500, f"Resource CREATE failed: a member of {name} failed")
            keys = set().union(*(m["attrs"] for m in members)) if members else set()
            st.resources[name] = {"type": rtype, "id": self.new_id(), "members": members,
                                  "attrs": {k: [m["attrs"].get(k) for m in members] for k in keys}}
            if not members:
                st.resources[name]["attrs"] = {"first_address": [], "name": []}
            return
        st.resources[name] = self._make(st, name, rtype, self.resolve(st, r.get("properties") or {}))

    def _make(self, st: Stack, name: str, rtype: str, p: dict) -> dict:
        c = self.cloud
        if rtype == "OS::Nova::KeyPair":
            from cryptography.hazmat.primitives import serialization
            from cryptography.hazmat.primitives.asymmetric import ed25519

            key = ed25519.Ed25519PrivateKey.generate()
            priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                     serialization.NoEncryption()).decode().strip()
            pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                serialization.PublicFormat.OpenSSH).decode()
            c.keypairs[p["name"]] = Keypair(p["name"], pub, c.user_id)
            return {"type": rtype, "id": p["name"], "keypair": p["name"],
                    "attrs": {"public_key": pub, "private_key": priv if p.get("save_private_key") else ""}}
        if rtype == "OS::Nova::Server":
            image = next((i.id for i in c.images if p.get("image") in (i.id, i.name)), None)
            if image is None:
                raise HeatError(400, f"Property error: {name}.Properties.image: Error validating value "
                                     f"'{p.get('image')}': No images matching {{'name': '{p.get('image')}'}}.")
            nets = []
            for n in p.get("networks") or []:
                if n.get("network") not in (c.sharednet.id, c.sharednet.name):
                    raise HeatError(400, f"Property error: {name}.Properties.networks: Unable to find network "
                                         f"with name or id '{n.get('network')}'")
                nets.append({"uuid": c.sharednet.id})
            ud = p.get("user_data") or ""
            body = {"server": {"name": p["name"], "flavorRef": p.get("flavor", "baremetal"), "imageRef": image,
                               "key_name": p.get("key_name"), "networks": nets,
                               "user_data": base64.b64encode(ud.encode()).decode() if ud else None},
                    "os:scheduler_hints": p.get("scheduler_hints") or {}}
            sid = c.create_servers(body)["server"]["id"]
            srv = c.servers[sid]
            while srv.status == "BUILD":
                time.sleep(0.2)  # the simulated server boots in another thread; Heat polls Nova the same way
            if srv.status != "ACTIVE" or srv.port is None:
                raise HeatError(500, f"Resource CREATE failed: {name}: {(srv.fault or {}).get('message')}")
            addrs = {net: [dict(a, port=srv.port.id) for a in lst] for net, lst in srv.addresses.items()}
            return {"type": rtype, "id": sid, "server": sid,
                    "attrs": {"first_address": srv.addresses["sharednet1"][0]["addr"], "name": srv.name,
                              "addresses": {**addrs, c.sharednet.id: addrs.get("sharednet1")},
                              "networks": {"sharednet1": [a["addr"] for a in srv.addresses["sharednet1"]]}}}
        if rtype == "OS::Neutron::FloatingIP":
            if p.get("floating_network") not in (c.public.id, c.public.name):
                raise HeatError(400, f"Property error: {name}: Unable to find network '{p.get('floating_network')}'")
            with c.lock:
                fip = c._new_fip()
            return {"type": rtype, "id": fip.id, "fip": fip.id,
                    "attrs": {"floating_ip_address": fip.floating_ip_address}}
        if rtype == "OS::Neutron::FloatingIPAssociation":
            c.associate(p["floatingip_id"], p["port_id"])
            return {"type": rtype, "id": self.new_id(), "attrs": {}}
        raise HeatError(400, f"The Resource Type ({rtype}) could not be found.", "Not Found")

    def delete(self, st: Stack) -> None:
        c = self.cloud
        st.event(st.name, "DELETE_IN_PROGRESS", "Stack DELETE started", st.id, "OS::Heat::Stack")
        servers = []
        with c.lock:
            for r in st.resources.values():
                for m in [r] + r.get("members", []):
                    if m.get("server") and m["server"] in c.servers:
                        servers.append(c.servers[m["server"]])
                        c._delete_server(servers[-1])
                    if m.get("fip"):
                        c._release_fip(m["fip"])
                    if m.get("keypair"):
                        c.keypairs.pop(m["keypair"], None)
        # a server resource's delete is complete once Nova no longer finds the server, not while its task_state
        # is "deleting" (heat/engine/clients/os/nova.py check_delete_server_complete)
        c.wait_deleted(servers)
        for name in st.resources:
            st.event(name, "DELETE_COMPLETE", "state changed", rtype=st.resources[name].get("type", ""))
        st.status, st.reason = "DELETE_COMPLETE", "Stack DELETE completed successfully"
        st.event(st.name, st.status, st.reason, st.id, "OS::Heat::Stack")
