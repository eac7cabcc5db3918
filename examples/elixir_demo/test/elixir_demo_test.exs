defmodule ElixirDemoTest do
  use ExUnit.Case, async: false
  import ElixirDemo.TestWait

  alias ElixirDemo.Relay

  @relays 4
  @count 500

  # A second node, started with :peer, with the code of convoy, Elixir and this
  # project on its path, running convoy. It is linked to the setup_all process,
  # so it stops when this module's tests are done.
  setup_all do
    paths = Enum.flat_map([:convoy, :elixir, :elixir_demo], &[~c"-pa", :code.lib_dir(&1, :ebin)])

    {:ok, _peer, node} =
      :peer.start_link(%{name: :peer.random_name(~c"elixir_demo_peer"), args: paths})

    {:ok, _} = :erpc.call(node, :application, :ensure_all_started, [:convoy])

    # Each side learns that the other runs convoy (until then sends go plain).
    await(fn -> route(node) == :convoy end)
    await(fn -> route(node, node()) == :convoy end)
    %{node: node}
  end

  # Relays on the peer that forward, through convoy, everything they get back to
  # a process here, which passes it on to the test tagged with the relay's number.
  setup %{node: node} do
    test = self()

    relays =
      for k <- 1..@relays do
        tagger = spawn_link(fn -> tag(test, k) end)
        {:ok, relay} = :erpc.call(node, Relay, :start, [[target: tagger]])
        {k, relay}
      end

    %{relays: relays}
  end

  test "send/2 delivers to processes on the other node, in order", %{relays: relays, node: node} do
    for i <- 1..@count, {_k, relay} <- relays, do: :ok = :convoy.send(relay, i)
    :ok = :convoy.flush()

    received = collect(@relays * @count)
    for {k, _} <- relays, do: assert(received[k] == Enum.to_list(1..@count))

    assert %{route: :convoy, accepted: accepted} = :convoy.info().nodes[node]
    assert accepted >= @relays * @count
  end

  test "multicast/2 reaches every process, in order with send/2", %{relays: relays} do
    pids = Enum.map(relays, &elem(&1, 1))

    for i <- 1..@count do
      :ok = :convoy.multicast(pids, {:all, i})
      for {_k, relay} <- relays, do: :ok = :convoy.send(relay, i)
    end

    received = collect(2 * @relays * @count)

    for {k, _} <- relays do
      assert received[k] == Enum.flat_map(1..@count, &[{:all, &1}, &1])
    end
  end

  test "options as keyword lists, as Elixir passes them", %{relays: [{k, relay} | _]} do
    :ok = :convoy.send(relay, :kw, overload: :error, block_timeout: 100)
    assert collect(1)[k] == [:kw]

    settings = :convoy.info().settings
    :ok = :convoy.set_config(max_batch: 500)
    assert %{max_batch: 500} = :convoy.info().settings
    assert {:error, {:duplicate_option, :max_batch}} = :convoy.set_config(max_batch: 1, max_batch: 2)
    assert {:error, {:not_a_map, :lanes}} = :convoy.set_config(:lanes)
    :ok = :convoy.set_config(settings)
  end

  test "batch/1 sends a loop's messages together, in order", %{relays: relays} do
    :ok =
      :convoy.batch(fn ->
        for i <- 1..@count, {_k, relay} <- relays, do: :ok = :convoy.send(relay, {:batched, i})
        :ok
      end)

    received = collect(@relays * @count)
    for {k, _} <- relays, do: assert(received[k] == Enum.map(1..@count, &{:batched, &1}))

    assert catch_throw(:convoy.batch(fn -> throw(:stop) end)) == :stop
  end

  describe "a GenServer on the other node, through convoy" do
    # A Tally registered on the peer, stopped after each test.
    setup %{node: node} do
      {:ok, tally} = :erpc.call(node, ElixirDemo.Tally, :start, [[name: ElixirDemo.Tally]])
      on_exit(fn -> :erpc.call(node, GenServer, :stop, [tally]) end)
      %{tally: tally}
    end

    test "cast/2 and call/2 reach it, in order", %{tally: tally, node: node} do
      by_name = {ElixirDemo.Tally, node}
      for i <- 1..@count, do: :ok = :convoy.cast(by_name, {:add, i})

      # The call travels behind the casts: it sees all of them, in order.
      assert :convoy.call(tally, :all) == Enum.to_list(1..@count)
      assert :convoy.call(by_name, :all, 5_000) == Enum.to_list(1..@count)

      # They went through convoy (batched by its lane, or sent directly).
      assert %{route: :convoy, accepted: accepted, direct: direct} = :convoy.info().nodes[node]
      assert accepted + direct >= @count + 2
    end

    test "call/2,3 exits as :gen_server.call does; no late reply is left", %{tally: tally, node: node} do
      missing = {:no_such_tally, node}
      assert {:noproc, {:gen_server, :call, [^missing, :all]}} = catch_exit(:convoy.call(missing, :all))
      assert catch_exit(:convoy.call(missing, :all)) == catch_exit(:gen_server.call(missing, :all))

      # Answered after 200 ms, with GenServer.reply/2: too late for a 50 ms call.
      late = {:late, 200, self()}
      assert {:timeout, {:gen_server, :call, [^tally, ^late, 50]}} = catch_exit(:convoy.call(tally, late, 50))
      assert_receive :replied, 5_000
      refute_received {[:alias | _], _}
      assert :convoy.call(tally, :all) == []
    end
  end

  defp tag(test, k) do
    receive do
      msg -> send(test, {:relayed, k, msg})
    end

    tag(test, k)
  end

  # n relayed messages, as %{k => [msg, ...]} in arrival order.
  defp collect(n), do: collect(n, %{}) |> Map.new(fn {k, msgs} -> {k, Enum.reverse(msgs)} end)
  defp collect(0, acc), do: acc

  defp collect(n, acc) do
    receive do
      {:relayed, k, msg} -> collect(n - 1, Map.update(acc, k, [msg], &[msg | &1]))
    after
      5_000 -> flunk("#{n} messages missing")
    end
  end
end
