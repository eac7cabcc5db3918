# The cluster tests need this node distributed, and before convoy starts (it
# records the node's name): mix.exs makes `mix test` mean `mix test --no-start`,
# so the applications are started here, after Node.start/2.
defmodule PhoenixPubsubConvoy.TestNode do
  # Starts epmd if it is not running (`epmd -daemon` returns before it listens,
  # so wait for it), then distribution under a name unique on this host (long
  # names on 127.0.0.1: nothing to resolve).
  def start do
    {_, 0} = System.cmd(System.find_executable("epmd") || "epmd", ["-daemon"])
    await_epmd(100)
    {:ok, _} = Node.start(:"phx_convoy_#{System.pid()}@127.0.0.1", :longnames)
  end

  defp await_epmd(0), do: raise("epmd is not answering")

  defp await_epmd(tries) do
    with {:error, _} <- :erl_epmd.names() do
      Process.sleep(50)
      await_epmd(tries - 1)
    end
  end
end

PhoenixPubsubConvoy.TestNode.start()
{:ok, _} = Application.ensure_all_started(:phoenix_pubsub_convoy)

ExUnit.start()
