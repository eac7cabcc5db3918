defmodule ElixirDemoPublishTest do
  use ExUnit.Case, async: false
  import ElixirDemo.TestWait

  alias ElixirDemo.Subscriber

  @count 300

  # A second node running convoy, as in ElixirDemoTest, and OTP's default :pg
  # scope on both nodes.
  setup_all do
    paths = Enum.flat_map([:convoy, :elixir, :elixir_demo], &[~c"-pa", :code.lib_dir(&1, :ebin)])

    {:ok, _peer, node} =
      :peer.start_link(%{name: :peer.random_name(~c"elixir_demo_pub"), args: paths})

    {:ok, _} = :erpc.call(node, :application, :ensure_all_started, [:convoy])
    for n <- [node(), node], do: :ok = start_pg(n)
    await(fn -> route(node) == :convoy end)
    await(fn -> route(node, node()) == :convoy end)
    %{node: node}
  end

  test "publish/2 reaches every member of a :pg group, on both nodes, in order",
       %{node: node} do
    group = {:demo_topic, make_ref()}
    test = self()

    remote =
      for _ <- 1..3 do
        {:ok, pid} = :erpc.call(node, Subscriber, :start, [[group: group, target: test]])
        pid
      end

    {:ok, local} = Subscriber.start_link(group: group, target: test)
    members = [local | remote]
    await(fn -> length(:pg.get_members(group)) == length(members) end)

    for i <- 1..@count, do: :ok = :convoy.publish(group, {:news, i})

    received = collect(length(members) * @count)
    expected = Enum.map(1..@count, &{:news, &1})
    for pid <- members, do: assert(received[pid] == expected)
  end

  defp start_pg(at) do
    case :erpc.call(at, :pg, :start, [:pg]) do
      {:ok, _} -> :ok
      {:error, {:already_started, _}} -> :ok
    end
  end

  # n forwarded messages, as %{member => [msg, ...]} in arrival order.
  defp collect(n), do: collect(n, %{}) |> Map.new(fn {k, msgs} -> {k, Enum.reverse(msgs)} end)
  defp collect(0, acc), do: acc

  defp collect(n, acc) do
    receive do
      {pid, msg} when is_pid(pid) -> collect(n - 1, Map.update(acc, pid, [msg], &[msg | &1]))
    after
      5_000 -> flunk("#{n} messages missing")
    end
  end
end
