import asyncio, time, sys
import pytest
from engine_fixtures import tiny, random_prompts
from worker_fixtures import Gateway, start_worker, params, rpc_error
from tandem.cluster import LocalCluster

NB = 64

@pytest.fixture(scope="module")
def workers():
    model = tiny("llama-gqa")[0]
    with LocalCluster() as c:
        p = start_worker(c, "prefill", model, NB, metrics=True)
        d = [start_worker(c, "decode", model, NB, metrics=True) for _ in range(2)]
        b = start_worker(c, "both", model, NB)
        yield model, p, d, b, c
        print("PREFILL", p.proc.output()[-5000:])
        print("DECODE", d[0].proc.output()[-5000:])

@pytest.mark.parametrize("transport", ["grpc", "torch"])
async def test_aborted_reservation(workers, transport):
    model, p, d, b, c = workers
    pr = random_prompts([100], seed=1)[0]
    sp = params(max_tokens=12, temperature=0, ignore_eos=True)
    async with Gateway() as gw:
        # warm the pair
        await gw.disaggregated(p, d[0], f"w-{transport}", pr, sp, transport)
        t = await gw.reserve(d[0], f"a-{transport}", pr, sp)
        print(await gw.abort(d[0], f"a-{transport}"))
        t0 = time.time()
        err = await rpc_error(gw.prefill(p, f"a-{transport}", pr, sp, t, transport))
        print(transport, "ERR", err.code(), err.details(), time.time() - t0)
        await gw.wait_idle([p, *d, b])
        t0 = time.time()
        r = await gw.disaggregated(p, d[0], f"w2-{transport}", pr, sp, transport)
        print("after", time.time() - t0)

async def test_misc(workers):
    model, p, d, b, c = workers
    pr = random_prompts([100], seed=1)[0]
    sp = params(max_tokens=12, temperature=0, ignore_eos=True)
    async with Gateway() as gw:
        err = await rpc_error(gw.decode(d[0], "nope", sp, first=type("F", (), {"first_token_id": 3})()))
        print("unknown", err.code(), err.details())
        err = await rpc_error(gw.colocated(b, "bad", pr, params(max_tokens=12, temperature=0) if False else __import__("rpc.protos", fromlist=["x"]).common_pb2.SamplingParams(temperature=-1)))
        print("bad", err.code(), err.details())
        t = await gw.reserve(d[0], "lease", pr, sp, lease_ms=300)
        print("free after reserve", (await gw.info(d[0])).free_blocks)
        await asyncio.sleep(1)
        print("free after expiry", (await gw.info(d[0])).free_blocks)
        err = await rpc_error(gw.prefill(p, "lease", pr, sp, t))
        print("expired", err.code(), err.details())
        # cancel prefill mid compute
        long = random_prompts([900], seed=2)[0]
        t = await gw.reserve(d[1], "cx", long, sp)
        task = asyncio.ensure_future(gw.prefill(p, "cx", long, sp, t))
        await asyncio.sleep(0.01)
        task.cancel()
        try: await task
        except BaseException as e: print("cancel:", type(e))
        print(await gw.abort(d[1], "cx"))
        await gw.wait_idle([p, *d, b])
