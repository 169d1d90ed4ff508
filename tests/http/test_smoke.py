from tests.conftest import ProxyHandle
from tests.fakes.backend import FakeBackend


async def test_three_turn_chain(proxy: ProxyHandle, backend: FakeBackend) -> None:
    client = proxy.client()
    r1 = await client.responses.create(model="m", input="hello")
    assert r1.output_text == "echo#1: hello"
    r2 = await client.responses.create(model="m", input="again", previous_response_id=r1.id)
    assert r2.output_text == "echo#3: again"
    r3 = await client.responses.create(model="m", input="third", previous_response_id=r2.id)
    assert r3.output_text == "echo#5: third"
    bodies = [s.json for s in backend.responses_seen]
    assert "previous_response_id" not in bodies[2]
