%% convoy_peers's readers on one node, without peers (the exchange and the table
%% across nodes: convoy_peers_SUITE).
-module(convoy_peers_tests).

-include_lib("eunit/include/eunit.hrl").

%% known_route/1 tells a node without a row (plain) from a table that is gone
%% (unknown), which route/1 does not.
known_route_test_() ->
    {timeout, 60, fun known_route/0}.

known_route() ->
    Node = 'nobody@nowhere',
    ?assertEqual(unknown, convoy_peers:known_route(Node)),
    ?assertEqual(plain, convoy_peers:route(Node)),
    {ok, Sup} = convoy:start_link(#{}),
    unlink(Sup),
    try
        ?assertEqual(plain, convoy_peers:known_route(Node)),
        ?assertEqual(plain, convoy_peers:route(Node)),
        {_, _} = convoy_peers:refs(Node), % a row, still plain
        ?assertEqual(plain, convoy_peers:known_route(Node))
    after
        ok = proc_lib:stop(Sup, shutdown, infinity)
    end,
    ?assertEqual(unknown, convoy_peers:known_route(Node)).
