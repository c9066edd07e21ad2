import sys, os, ssl, socket, threading, time, tempfile, multiprocessing as mp
root = sys.argv[1]; sys.path.insert(0, root); sys.path.insert(0, "/work/main/bench")
from pathlib import Path
from appliance.localcloud.rgw_server import self_signed
from appliance.store import httpget
SIZE = 256 << 20
def serve(cert, key, q):
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); sctx.load_cert_chain(cert, key)
    ls = socket.create_server(("127.0.0.1", 0)); q.put(ls.getsockname()[1])
    chunk = os.urandom(1 << 20)
    def one(c):
        with sctx.wrap_socket(c, server_side=True) as t:
            while True:
                req = b""
                while b"\r\n\r\n" not in req:
                    d = t.recv(65536)
                    if not d: return
                    req += d
                t.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % SIZE)
                for _ in range(SIZE >> 20): t.sendall(chunk)
    while True:
        c, _ = ls.accept(); threading.Thread(target=one, args=(c,), daemon=True).start()
d = Path(tempfile.mkdtemp()); cert, key = self_signed(d, "127.0.0.1")
os.environ["REQUESTS_CA_BUNDLE"] = str(cert)
q = mp.Queue(); p = mp.Process(target=serve, args=(cert, key, q), daemon=True); p.start(); port = q.get()
fd = os.open("/var/tmp/appliance-exp-onefile", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
import zlib
T = int(sys.argv[2]) if len(sys.argv) > 2 else 8
def work(k):
    f = os.open(f"/var/tmp/appliance-exp-f{k}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    c = [0]
    httpget.get_into(f"https://127.0.0.1:{port}/x", {}, f, 0, lambda v: c.__setitem__(0, zlib.crc32(v, c[0])))
    os.close(f)
for i in range(3):
    r0 = os.times(); t0 = time.time()
    ts = [threading.Thread(target=work, args=(k,)) for k in range(T)]
    [t.start() for t in ts]; [t.join() for t in ts]
    r1 = os.times()
    print(root, i, "wall %.2f user %.2f sys %.2f" % (time.time() - t0, r1.user - r0.user, r1.system - r0.system), flush=True)
os.system("rm -f /var/tmp/appliance-exp-f*")
p.kill()
